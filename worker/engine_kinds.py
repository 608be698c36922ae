"""Engine kind (``engine.kind`` in settings) → the engine that serves it, by its row in
``ocrq.engine_registry``.

Engines are imported when built, so a CPU worker never imports torch or vLLM. It lives above
``worker.engines`` so that the engines folder never imports its own subfolders (no folder circle)."""

from __future__ import annotations

import importlib
from functools import reduce
from typing import Any

from ocrq.engine_registry import engine_kind
from ocrq.settings import EngineSettings
from worker.engines.base import Engine


def build_engine(settings: EngineSettings) -> Engine:
    """The engine of ``settings.kind``, made by its row's factory from ``settings``."""
    engine: Engine = factory_of(settings.kind)(settings)
    return engine


def factory_of(kind: str) -> Any:
    """The callable ``kind``'s row names (imports its module: torch or vLLM for a GPU engine)."""
    module, _, attribute = engine_kind(kind).factory.partition(":")
    return reduce(getattr, attribute.split("."), importlib.import_module(module))
