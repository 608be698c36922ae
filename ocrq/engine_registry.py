"""Every engine kind ocrq knows, in one table: ``engine.kind`` → the class that serves it, what
it runs and where it computes.

Adding an engine is one module (a class with the ``worker.engines.base.Engine`` members, and any
of the capability protocols beside it) plus one row here. The settings accept the new kind, the
worker builds it (``worker.engine_kinds.build_engine``), producers read its tasks from the
capabilities a worker publishes (``ocrq.capabilities``), and ``ocrq up --gpus`` knows whether it
wants a GPU. Classes are named by import path, so this contract imports no engine (a CPU worker
never imports torch or vLLM; the producer imports no worker code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: where an engine computes: "cpu" (this host's CPU, whatever GPU it has), "gpu" (the GPU a worker
#: is given), "remote" (a server's: the worker itself needs no GPU)
Device = Literal["cpu", "gpu", "remote"]


@dataclass(frozen=True)
class EngineKind:
    #: the ``engine.kind`` setting
    kind: str
    #: ``module:attribute`` of the callable that takes the engine's settings and returns the engine
    factory: str
    #: the tasks of ``ocrq.messages.TASKS`` it runs; None: every one
    tasks: tuple[str, ...] | None
    #: whether it follows ``params["prompt"]`` (a custom prompt: an OpenAI Batch line's own text)
    custom_prompt: bool
    device: Device
    #: ``ocrq up --gpus`` runs one worker per GPU with it (None: when ``device`` is "gpu")
    per_gpu: bool | None = None
    #: hosts HunyuanOCR (the model of docs/gpu.md)
    hunyuan: bool = False
    #: for tests only: left out of what a refusal names as engines that could run a task
    test_only: bool = False

    @property
    def runs_per_gpu(self) -> bool:
        return self.device == "gpu" if self.per_gpu is None else self.per_gpu


ENGINES: dict[str, EngineKind] = {row.kind: row for row in (
    EngineKind("rapidocr", "worker.engines.rapid:RapidOcrEngine", ("text", "spotting"), False, "cpu"),
    EngineKind("transformers", "worker.engines.transformers.engine:TransformersEngine", None, True, "gpu",
               hunyuan=True),
    EngineKind("vllm", "worker.engines.vllm.engine:VllmEngine", None, True, "gpu", hunyuan=True),
    EngineKind("vllm-server", "worker.engines.vllm.server:VllmServerEngine", None, True, "remote", hunyuan=True),
    # stands in for a GPU engine in tests: pinned per GPU, computing nothing there
    EngineKind("simulated", "worker.engines.simulated:SimulatedEngine.from_settings", None, True, "cpu",
               per_gpu=True, test_only=True),
)}


def engine_kind(kind: str) -> EngineKind:
    """The row of ``kind``; ``ValueError`` naming the known kinds when there is none."""
    row = ENGINES.get(kind)
    if row is None:
        raise ValueError(f"unknown engine kind {kind!r}: one of {', '.join(ENGINES)}")
    return row
