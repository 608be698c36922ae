"""Which GPUs this host has, and the worker processes ``ocrq up --gpus`` starts on them.

One worker per GPU (``engine.engines_per_gpu`` of them with the vllm engine, each with its share of
the GPU's budget: vLLM's engine core is one CPU thread, the bound on an H200; the engines only run
at once under NVIDIA MPS, see ``sharing_note``). Each sees only its
own GPU (``CUDA_VISIBLE_DEVICES`` = that GPU's UUID, exact whatever order CUDA would number devices
in), is named ``gpu{index}@{host}`` (nvidia-smi's index; ``gpu{index}.{k}@{host}`` for the k-th
engine sharing it) and serves its metrics on a port of its own, so workers on one host never
collide and a GPU keeps its port when others are left out. The plan is plain data
(``WorkerPlan``): the stack spawns it, and tests check it on a machine without a GPU.

NVML (nvidia-ml-py) is imported lazily; no library, no driver or no device reads as an empty list,
and selecting from an empty list says so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ocrq.engine_registry import engine_kind
from ocrq.engine_settings import VllmSettings
from ocrq.settings import Settings

log = logging.getLogger(__name__)

#: where NVIDIA's MPS control daemon makes its pipes unless ``CUDA_MPS_PIPE_DIRECTORY`` says otherwise
MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"


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
    #: a worker on the same GPU that must be ready before this one starts: an engine sizes its
    #: KV cache from what the GPU has free, so two must not profile memory at once
    after: WorkerPlan | None = None


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


def share_env(settings: Settings, share: int) -> dict[str, str]:
    """Settings (as environment) that give a worker 1/``share`` of its GPU's budget: the engine's
    utilization and any memory cap, divided. Empty for a GPU of its own."""
    engine = settings.engine
    if share == 1 or not isinstance(engine, VllmSettings):
        return {}
    # floor at vLLM's 4 decimals: the shares never add up to more than the whole
    env = {"OCRQ_ENGINE__GPU_MEMORY_UTILIZATION": f"{int(engine.gpu_memory_utilization / share * 1e4) / 1e4}"}
    if settings.batch.memory_cap_bytes:
        env["OCRQ_BATCH__MEMORY_CAP_BYTES"] = str(settings.batch.memory_cap_bytes // share)
    if engine.memory_cap_bytes:
        env["OCRQ_ENGINE__MEMORY_CAP_BYTES"] = str(engine.memory_cap_bytes // share)
    return env


def engines_per_gpu(settings: Settings) -> int:
    """``engine.engines_per_gpu`` (vLLM's engines; 1 for any other)."""
    return settings.engine.engines_per_gpu if isinstance(settings.engine, VllmSettings) else 1


def _mps_control(environ: Mapping[str, str]) -> Path:
    """The MPS control pipe CUDA clients started with ``environ`` look for."""
    return Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT) / "control"


def mps_running(environ: Mapping[str, str]) -> bool:
    """Whether an MPS control daemon listens where CUDA clients started with ``environ`` look."""
    return _mps_control(environ).exists()


def sharing_note(settings: Settings, environ: Mapping[str, str]) -> str | None:
    """A warning for engines sharing a GPU without MPS: processes then take turns on the GPU (no
    kernel of one runs beside the other's). On the H200 two engines gave 0.84x of the pair under
    MPS (14.80 vs 17.71 img/s warm, docs/bench/gpu-vllm.md), itself 1.01x one engine on the same machine."""
    per_gpu = engines_per_gpu(settings)
    if per_gpu == 1 or mps_running(environ):
        return None
    return (f"engine.engines_per_gpu is {per_gpu} and no MPS daemon answers "
            f"({_mps_control(environ)} is missing): "
            "the engines will take turns on each GPU, slower than one engine; start "
            "`nvidia-cuda-mps-control -d` first (docs/gpu.md, Several engines on one GPU)")


def plan_gpu_workers(settings: Settings, gpus: list[Gpu], host: str) -> list[WorkerPlan]:
    """One worker per GPU, or ``engine.engines_per_gpu`` (vllm), all first ones first: ``gpu0@host``,
    then ``gpu0.1@host`` … Raises ValueError when the configured engine does not use a GPU, or
    shares one and is not vllm."""
    if not engine_kind(settings.engine.kind).runs_per_gpu:  # one per GPU would only multiply CPU work
        raise ValueError(f"--gpus: engine.kind is {settings.engine.kind}, which does not run on a local GPU; "
                         "use a GPU profile, e.g. --config configs/gpu-vllm.yaml")
    per_gpu = engines_per_gpu(settings)
    if per_gpu > 1 and settings.engine.kind != "vllm":
        # the transformers governor plans against the GPU's free memory, which a second process
        # changes under it; vLLM claims its share once, at start
        raise ValueError(f"engine.engines_per_gpu is {per_gpu}: sharing a GPU needs engine.kind vllm "
                         f"(this profile has {settings.engine.kind})")
    share = share_env(settings, per_gpu)
    plans: list[WorkerPlan] = []
    for k in range(per_gpu):
        for gpu in gpus:
            # stable per GPU whatever others are left out
            port = settings.metrics_port + gpu.index * per_gpu + k if settings.metrics_port else 0
            env = {
                "CUDA_VISIBLE_DEVICES": gpu.uuid,
                # indices in anything the worker prints or reads mean nvidia-smi's (NVML's) order
                "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                "OCRQ_METRICS_PORT": str(port),
                **share,
            }
            suffix = f".{k}" if k else ""
            plan = WorkerPlan(service=f"worker-gpu{gpu.index}{suffix}", node=f"gpu{gpu.index}{suffix}@{host}",
                              env=env, metrics_port=port, gpu=gpu, after=plans[-len(gpus)] if k else None)
            plans.append(plan)
    return plans


def embedded_worker(settings: Settings, host: str) -> WorkerPlan:
    """The one worker ``ocrq up`` starts without ``--gpus`` (its engine's own device choice)."""
    return WorkerPlan(service="worker", node=f"embedded@{host}", metrics_port=settings.metrics_port)
