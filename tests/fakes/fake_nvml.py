"""Fakes for device-memory reads: a ``MemoryProbe`` with settable numbers, and a stand-in for the
``pynvml`` module so ``NvmlProbe``'s device selection runs without a GPU."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from worker.nvml import DeviceMemory


@dataclass
class FakeNvml:
    """A ``MemoryProbe``: ``used`` is whatever the test says the device holds right now."""

    total: int
    used: int = 0
    reads: int = 0

    def read(self) -> DeviceMemory | None:
        self.reads += 1
        return DeviceMemory(total=self.total, free=max(0, self.total - self.used), used=self.used)


class FakeNVMLError(Exception):
    pass


@dataclass
class FakePynvmlModule:
    """Enough of pynvml's API for ``NvmlProbe``: devices are (uuid, total, used) triples."""

    devices: list[tuple[str, int, int]]
    fail_init: bool = False
    #: the next this-many memory reads raise (a driver hiccup), then reads work again
    fail_reads: int = 0
    calls: list[str] = field(default_factory=list)
    NVMLError: type[Exception] = FakeNVMLError

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.fail_init:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.devices):
            raise FakeNVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for index, (full, _, _) in enumerate(self.devices):
            if full == uuid:
                return index
        raise FakeNVMLError("Not Found")

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return self.devices[handle][0].encode()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        if self.fail_reads > 0:
            self.fail_reads -= 1
            raise FakeNVMLError("GPU is lost")
        _, total, used = self.devices[handle]
        return SimpleNamespace(total=total, free=total - used, used=used)
