"""Device memory as NVML sees it (every process on the GPU), behind a one-method protocol.

The governor takes these numbers as plain ints, so tests swap the probe for a fake. On a CPU host,
or where nvidia-ml-py / the driver is missing, ``NvmlProbe.for_current_device()`` hands back a
``NullProbe`` and ``read()`` returns None: nothing here raises on a machine without a GPU.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int
    used: int


class MemoryProbe(Protocol):
    def read(self) -> DeviceMemory | None:
        """Memory of this worker's device now; None when there is no device to read."""
        ...


class NullProbe:
    """No GPU (or no NVML): the governor then plans without a device figure."""

    def read(self) -> DeviceMemory | None:
        return None

    def close(self) -> None:
        pass


def visible_device(env: Mapping[str, str]) -> str | None:
    """The device this process's CUDA device 0 is, as CUDA_VISIBLE_DEVICES names it: an index
    ("0"), a UUID or UUID prefix ("GPU-…", "MIG-…"); "0" when unset; None when it hides all GPUs.

    NVML numbers devices in PCI bus order; CUDA does too with CUDA_DEVICE_ORDER=PCI_BUS_ID, which
    ``ocrq worker`` sets unless the environment already chose an order (``pin_pci_order``), so an
    index means the same GPU to both. UUIDs (what ``ocrq up --gpus`` passes) are exact either way."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return "0"
    first = raw.split(",")[0].strip()
    if not first or first.startswith("-") or first.lower() in ("none", "void", "nodevfiles"):
        return None
    return first


def pin_pci_order(env: MutableMapping[str, str]) -> None:
    """Make CUDA number GPUs as NVML and nvidia-smi do (PCI bus order) unless the operator chose an
    order. CUDA's default (fastest first) can differ on a host with mixed GPUs, and then index
    ``1`` in CUDA_VISIBLE_DEVICES would be one GPU to CUDA and another to this probe. Called before
    anything initialises CUDA (the variable is read once, at initialisation)."""
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


class NvmlProbe:
    """Reads one device through ``pynvml`` (nvidia-ml-py), imported lazily. Failures are logged
    once and read as None, so a flaky driver degrades the governor to count mode, never kills
    the worker."""

    def __init__(self, device: str, nvml: Any = None) -> None:
        self.device = device
        self._nvml = nvml
        self._handle: Any = None
        self._initialised = False
        self._warned = False
        self._lock = threading.Lock()

    @classmethod
    def for_current_device(cls, env: Mapping[str, str] | None = None) -> MemoryProbe:
        """A probe for the GPU this process's CUDA device 0 is, or a ``NullProbe``."""
        env = os.environ if env is None else env
        device = visible_device(env)
        if device is None:
            return NullProbe()
        if device.isdigit() and env.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID") != "PCI_BUS_ID":
            log.warning("CUDA_VISIBLE_DEVICES=%s with CUDA_DEVICE_ORDER=%s: CUDA's index may name another "
                        "GPU than NVML's on a mixed host; memory is read from NVML device %s (use a UUID "
                        "to be exact)", env.get("CUDA_VISIBLE_DEVICES"), env["CUDA_DEVICE_ORDER"], device)
        try:
            import pynvml
        except ImportError:
            return NullProbe()
        probe = cls(device, nvml=pynvml)
        probe._warned = True  # no GPU here is the normal CPU case: the first read stays quiet
        if probe.read() is None:
            probe.close()
            log.info("no NVML device: the governor plans by count and engine figures only")
            return NullProbe()
        probe._warned = False
        return probe

    def read(self) -> DeviceMemory | None:
        try:
            with self._lock:
                handle = self._handle if self._handle is not None else self._open()
                info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            return DeviceMemory(total=int(info.total), free=int(info.free), used=int(info.used))
        except Exception as exc:  # NVMLError, missing library, driver reset: never fatal
            if not self._warned:
                log.warning("NVML read of device %s failed: %s", self.device, exc)
                self._warned = True
            return None

    def _open(self) -> Any:
        if self._nvml is None:
            import pynvml

            self._nvml = pynvml
        nvml = self._nvml
        if not self._initialised:
            nvml.nvmlInit()
            self._initialised = True
        if self.device.isdigit():
            self._handle = nvml.nvmlDeviceGetHandleByIndex(int(self.device))
        else:
            self._handle = self._by_uuid(self.device)
        return self._handle

    def _by_uuid(self, uuid: str) -> Any:
        try:
            return self._nvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:
            # CUDA accepts unique UUID prefixes; NVML wants the whole UUID: match by enumeration
            # (GPUs, and the MIG instances of GPUs in MIG mode)
            for handle in self._all_handles():
                full = self._nvml.nvmlDeviceGetUUID(handle)
                full = full.decode() if isinstance(full, bytes) else str(full)
                if full.startswith(uuid):
                    return handle
            raise

    def _all_handles(self) -> list[Any]:
        nvml = self._nvml
        handles = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            gpu = nvml.nvmlDeviceGetHandleByIndex(index)
            handles.append(gpu)
            try:
                slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu))
            except Exception:  # not MIG-capable, or an NVML without MIG calls
                slots = 0
            for slot in range(slots):
                try:
                    handles.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot))
                except Exception:  # an empty slot
                    continue
        return handles

    def close(self) -> None:
        with self._lock:
            if self._initialised and self._nvml is not None:
                try:
                    self._nvml.nvmlShutdown()
                except Exception:  # shutting down a broken NVML must not raise either
                    pass
            self._initialised = False
            self._handle = None
