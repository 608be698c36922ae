"""Which GPUs this host has, and the worker processes ``ocrq up --gpus`` starts on them.

One worker per GPU: each sees only its own GPU (``CUDA_VISIBLE_DEVICES`` = that GPU's UUID, exact
whatever order CUDA would number devices in), is named ``gpu{index}@{host}`` (nvidia-smi's index)
and serves its metrics on ``metrics_port + index``, so workers on one host never collide and a
GPU keeps its port when others are left out. The plan is plain data (``WorkerPlan``): the stack
spawns it, and tests check it on a machine without a GPU.

NVML (nvidia-ml-py) is imported lazily; no library, no driver or no device reads as an empty list,
and selecting from an empty list says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ocrq.settings import Settings

log = logging.getLogger(__name__)

#: engines that do not run on a local GPU: one worker per GPU would only multiply CPU work
CPU_ENGINES = ("rapidocr", "vllm-server")


@dataclass(frozen=True)
class Gpu:
    #: NVML's index (PCI bus order, what nvidia-smi shows)
    index: int
    uuid: str
    name: str = ""
    total_bytes: int = 0


@dataclass(frozen=True)
class WorkerPlan:
    """One worker process of the embedded stack: what it is called and the environment it gets."""

    #: pid and log file name under the var dir (``worker`` for the embedded CPU worker)
    service: str
    #: Celery node name (unique in the fleet)
    node: str
    #: added to the stack's environment for this process only
    env: dict[str, str] = field(default_factory=dict)
    metrics_port: int = 0
    gpu: Gpu | None = None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def list_gpus(nvml: Any = None) -> list[Gpu]:
    """The host's GPUs as NVML enumerates them; [] without nvidia-ml-py, a driver or a device."""
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return []
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded: a host without GPUs
        log.debug("NVML not available: %s", exc)
        return []
    try:
        gpus = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(Gpu(index=index, uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                            name=_text(nvml.nvmlDeviceGetName(handle)),
                            total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total)))
        return gpus
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # a failing shutdown changes nothing about what was read
            pass


def select_gpus(spec: str, gpus: list[Gpu]) -> list[Gpu]:
    """``all`` or a comma-separated list of NVML indices / UUIDs (or unique UUID prefixes), checked
    against the GPUs found. Raises ValueError with what the host does have."""
    have = ", ".join(f"{g.index} ({g.name or g.uuid})" for g in gpus)
    if not gpus:
        raise ValueError(f"--gpus {spec}: no GPU found on this host (NVML sees none: no NVIDIA "
                         "driver, no device, or nvidia-ml-py not installed)")
    if spec.strip().lower() == "all":
        return list(gpus)
    picked: list[Gpu] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            raise ValueError(f"--gpus {spec!r}: empty entry; use all or indices like 0,1")
        if item.isdigit():
            matches = [g for g in gpus if g.index == int(item)]
        else:
            matches = [g for g in gpus if g.uuid.startswith(item)]
        if len(matches) != 1:
            what = "matches several GPUs" if matches else "is not a GPU of this host"
            raise ValueError(f"--gpus {spec}: {item} {what}; this host has {have}")
        if matches[0] in picked:
            raise ValueError(f"--gpus {spec}: GPU {matches[0].index} listed twice (one worker per GPU)")
        picked.append(matches[0])
    return picked


def plan_gpu_workers(settings: Settings, gpus: list[Gpu], host: str) -> list[WorkerPlan]:
    """One worker per GPU. Raises ValueError when the configured engine does not use a GPU."""
    if settings.engine.kind in CPU_ENGINES:
        raise ValueError(f"--gpus: engine.kind is {settings.engine.kind}, which does not run on a local GPU; "
                         "use a GPU profile, e.g. --config configs/gpu-vllm.yaml")
    plans = []
    for gpu in gpus:
        port = settings.metrics_port + gpu.index if settings.metrics_port else 0
        env = {
            "CUDA_VISIBLE_DEVICES": gpu.uuid,
            # indices in anything the worker prints or reads mean nvidia-smi's (NVML's) order
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "OCRQ_METRICS_PORT": str(port),
        }
        plans.append(WorkerPlan(service=f"worker-gpu{gpu.index}", node=f"gpu{gpu.index}@{host}", env=env,
                                metrics_port=port, gpu=gpu))
    return plans


def embedded_worker(settings: Settings, host: str) -> WorkerPlan:
    """The one worker ``ocrq up`` starts without ``--gpus`` (its engine's own device choice)."""
    return WorkerPlan(service="worker", node=f"embedded@{host}", metrics_port=settings.metrics_port)
