"""Fakes for device-memory reads: a ``MemoryProbe`` with settable numbers, and a stand-in for the
``pynvml`` module so ``NvmlProbe``'s device selection runs without a GPU."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from worker.memory.nvml import DeviceMemory


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
    """Enough of pynvml's API for ``NvmlProbe`` and ``ocrq_cli.embedded.gpus.list_gpus``: devices are
    (uuid, total, used) triples in NVML's (PCI) order; ``mig`` maps a device index to its MIG
    instances, (uuid, total, used) each, whose handles are ("mig", device, slot)."""

    devices: list[tuple[str, int, int]]
    mig: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict)
    name: str = "NVIDIA H200"
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

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        # whole GPU UUIDs only: the probe must find MIG instances and UUID prefixes itself
        for index, (full, _, _) in enumerate(self.devices):
            if full == uuid:
                return index
        raise FakeNVMLError("Not Found")

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: int) -> int:
        return len(self.mig.get(handle, []))

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int, slot: int) -> Any:
        if slot >= len(self.mig.get(handle, [])):
            raise FakeNVMLError("Not Found")
        return ("mig", handle, slot)

    def _device(self, handle: Any) -> tuple[str, int, int]:
        if isinstance(handle, tuple):
            return self.mig[handle[1]][handle[2]]
        return self.devices[handle]

    def nvmlDeviceGetUUID(self, handle: Any) -> bytes:
        return self._device(handle)[0].encode()

    def nvmlDeviceGetName(self, handle: Any) -> bytes:
        return self.name.encode()

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        if self.fail_reads > 0:
            self.fail_reads -= 1
            raise FakeNVMLError("GPU is lost")
        _, total, used = self._device(handle)
        return SimpleNamespace(total=total, free=total - used, used=used)
