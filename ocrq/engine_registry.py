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

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from ocrq.engine_settings import (
    EngineSettings,
    RapidOcrSettings,
    SimulatedSettings,
    TransformersSettings,
    VllmServerSettings,
    VllmSettings,
)
from ocrq.setting_json import decoded

#: where an engine computes: "cpu" (this host's CPU, whatever GPU it has), "gpu" (the GPU a worker
#: is given), "remote" (a server's: the worker itself needs no GPU)
Device = Literal["cpu", "gpu", "remote"]


@dataclass(frozen=True)
class EngineKind:
    #: the ``engine.kind`` setting
    kind: str
    #: ``module:attribute`` of the callable that takes the engine's settings and returns the engine
    factory: str
    #: the class of its settings (``ocrq.engine_settings``)
    settings: type[EngineSettings]
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
    EngineKind("rapidocr", "worker.engines.rapid:RapidOcrEngine", RapidOcrSettings, ("text", "spotting"), False,
               "cpu"),
    EngineKind("transformers", "worker.engines.transformers.engine:TransformersEngine", TransformersSettings, None,
               True, "gpu", hunyuan=True),
    EngineKind("vllm", "worker.engines.vllm.engine:VllmEngine", VllmSettings, None, True, "gpu", hunyuan=True),
    EngineKind("vllm-server", "worker.engines.vllm.server:VllmServerEngine", VllmServerSettings, None, True,
               "remote", hunyuan=True),
    # stands in for a GPU engine in tests: pinned per GPU, computing nothing there
    EngineKind("simulated", "worker.engines.simulated:SimulatedEngine.from_settings", SimulatedSettings, None,
               True, "cpu", per_gpu=True, test_only=True),
)}


def engine_kind(kind: str) -> EngineKind:
    """The row of ``kind``; ``ValueError`` naming the known kinds when there is none."""
    row = ENGINES.get(kind)
    if row is None:
        raise ValueError(f"unknown engine kind {kind!r}: one of {', '.join(ENGINES)}")
    return row


log = logging.getLogger("ocrq.settings")


def settings_class(kind: str) -> type[EngineSettings]:
    """The class of ``kind``'s settings (``ValueError`` naming the known kinds when there is none)."""
    return engine_kind(kind).settings


def all_engine_fields() -> dict[str, FieldInfo]:
    """Every engine kind's settings fields (what ``OCRQ_ENGINE__*`` may name), ``kind`` first."""
    out: dict[str, FieldInfo] = dict(EngineSettings.model_fields)
    for row in ENGINES.values():
        for name, field in row.settings.model_fields.items():
            out.setdefault(name, field)
    return out


def engine_settings(data: Mapping[str, Any] | None = None, /, **values: Any) -> EngineSettings:
    """The settings of the engine ``kind`` names (default rapidocr) from ``data`` and ``values``.
    A key another engine has and this one does not is dropped with a deprecation note; an unknown
    kind is a ``ValidationError`` at ``kind``, as a ``Literal`` of the registry's kinds would be."""
    raw = {**(data or {}), **values}
    kind = raw.get("kind", "rapidocr")
    if not isinstance(kind, str) or kind not in ENGINES:
        known = [repr(k) for k in ENGINES]
        expected = f"{', '.join(known[:-1])} or {known[-1]}"
        error = PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
        raise ValidationError.from_exception_data("EngineSettings", [{"type": error, "loc": ("kind",), "input": kind}])
    cls = settings_class(kind)
    every = all_engine_fields()
    foreign = sorted(k for k in raw if k not in cls.model_fields and k in every)
    if foreign:
        log.warning("deprecated: engine.%s %s not read by the %s engine (engine.kind): ignored; remove %s",
                    ", engine.".join(foreign), "is" if len(foreign) == 1 else "are", kind,
                    "it" if len(foreign) == 1 else "them")
    # the environment's JSON for this class's lists and mappings (ocrq.setting_json)
    kept = {k: decoded(v, cls.model_fields[k].annotation) if k in cls.model_fields else v
            for k, v in raw.items() if k not in foreign}
    return cls.model_validate(kept)
