"""The share of the GPU vLLM may claim: ``gpu_memory_utilization`` sized from what the device
has free when the engine starts, so other processes on the GPU are left their memory."""

from __future__ import annotations

from ocrq.errors import TooLargeForDevice

#: device memory left to the CUDA context, other processes' growth and fragmentation when
#: ``gpu_memory_utilization`` is sized from what NVML reports free at start
GPU_RESERVE_BYTES = 1 << 30


def gpu_utilization(requested: float, total: int, free: int, reserve: int = GPU_RESERVE_BYTES) -> float:
    """The ``gpu_memory_utilization`` vLLM can actually get: vLLM claims that fraction of the
    *total* and refuses to start when less is free, so other processes on the GPU are taken out."""
    if total <= 0:
        raise ValueError("device total must be positive")
    fits = (free - reserve) / total
    if fits <= 0.05:
        raise TooLargeForDevice(
            f"only {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB free on the GPU: no room for vLLM"
        )
    return round(min(requested, fits), 4)


def device_memory() -> tuple[int, int]:
    """(total, free) bytes of this process's GPU as NVML sees it (every process), else as the
    CUDA driver does."""
    from worker.memory.nvml import NvmlProbe

    probe = NvmlProbe.for_current_device()
    device = probe.read()
    getattr(probe, "close", lambda: None)()
    if device is not None:
        return device.total, device.free
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total), int(free)
