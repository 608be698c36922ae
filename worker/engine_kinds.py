"""Engine kind (``engine.kind`` in settings) → the engine that serves it.

Engines are imported lazily so a CPU worker never imports torch or vLLM. It lives above
``worker.engines`` so that the engines folder never imports its own subfolders (no folder circle)."""

from __future__ import annotations

from ocrq.settings import EngineSettings
from worker.engines.base import Engine


def build_engine(settings: EngineSettings) -> Engine:
    kind = settings.kind
    if kind == "rapidocr":
        from worker.engines.rapid import RapidOcrEngine

        return RapidOcrEngine(settings)
    if kind == "transformers":
        from worker.engines.transformers.engine import TransformersEngine

        return TransformersEngine(settings)
    if kind == "vllm":
        from worker.engines.vllm.engine import VllmEngine

        return VllmEngine(settings)
    if kind == "vllm-server":
        from worker.engines.vllm.server import VllmServerEngine

        return VllmServerEngine(settings)
    if kind == "simulated":
        from worker.engines.simulated import SimulatedEngine

        return SimulatedEngine.from_settings(settings)
    raise ValueError(f"unknown engine kind {kind!r}")
