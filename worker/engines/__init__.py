"""OCR engines behind one interface (``base.Engine``); ``build_engine`` picks one from settings.

Engines are imported lazily so a CPU worker never imports torch or vLLM."""

from __future__ import annotations

from ocrq.settings import EngineSettings
from worker.engines.base import Engine


def build_engine(settings: EngineSettings) -> Engine:
    kind = settings.kind
    if kind == "rapidocr":
        from worker.engines.rapid import RapidOcrEngine

        return RapidOcrEngine(settings)
    if kind == "transformers":
        from worker.engines.transformers_engine import TransformersEngine

        return TransformersEngine(settings)
    if kind == "vllm":
        from worker.engines.vllm_engine import VllmEngine

        return VllmEngine(settings)
    if kind == "vllm-server":
        from worker.engines.vllm_server import VllmServerEngine

        return VllmServerEngine(settings)
    if kind == "simulated":
        from worker.engines.simulated import SimulatedEngine

        return SimulatedEngine.from_settings(settings)
    raise ValueError(f"unknown engine kind {kind!r}")
