"""The engine interface every OCR backend implements.

An engine takes a micro-batch of decoded images and returns one outcome per image, in order:
an ``OcrOutput`` or an ``OcrqError`` for that image alone. A failure of the whole batch that is a
memory problem raises ``EngineOOM`` (the engine loop bisects and retries the halves); any other
whole-batch failure raises ``EngineCrashed``/``EngineTimeout``.

Invariant (tested for every engine): an image's output never depends on the batch it ran in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from PIL import Image

from ocrq.errors import OcrqError
from ocrq.results import OcrOutput
from worker.memory.costs import ImageCost, MemorySample

__all__ = ["Engine", "ImageCost", "MemorySample", "OcrRequest"]


@dataclass(frozen=True)
class OcrRequest:
    #: stable id for logs and futures (image id + page)
    key: str
    #: decoded RGB image, already within the pixel cap
    image: Image.Image
    #: "text" (plain reading), "parse" (markdown), "spotting" (text + boxes), "extract", "translate"
    task: str = "text"
    #: task parameters (fields for extract, target language, max_new_tokens, ...)
    params: Mapping[str, Any] = field(default_factory=dict)
    #: 0 = most urgent (the chunk's broker priority): the engine loop takes urgent images first
    priority: int = 0


@runtime_checkable
class Engine(Protocol):
    #: engine family: "rapidocr" | "transformers" | "vllm" | "vllm-server"
    name: str

    @property
    def revision(self) -> str:
        """Model + weights revision; part of every cache key (changing it invalidates the cache)."""
        ...

    def start(self) -> None:
        """Load models; called once in the worker process before it consumes anything."""
        ...

    def cost(self, request: OcrRequest) -> ImageCost:
        """Token cost of one image (vision tokens by the model's resize rule + prompt + output)."""
        ...

    def infer(self, batch: Sequence[OcrRequest]) -> list[OcrOutput | OcrqError]:
        """Run one micro-batch. One outcome per request, same order."""
        ...

    def memory(self) -> MemorySample:
        """Current device-memory accounting; ``MemorySample()`` when the engine has none."""
        ...

    def reset_peak(self) -> None:
        """Start a new peak-memory window (called before each batch)."""
        ...

    def close(self) -> None:
        ...
