"""The engine interface every OCR backend implements.

An engine takes a micro-batch of decoded images and returns one outcome per image, in order:
an ``OcrOutput`` or an ``OcrqError`` for that image alone. A failure of the whole batch that is a
memory problem raises ``EngineOOM`` (the engine loop bisects and retries the halves); any other
whole-batch failure raises ``EngineCrashed``/``EngineTimeout``.

Invariant (tested for every engine): an image's output never depends on the batch it ran in.

Beyond ``Engine``, an engine may have any of the capabilities below (small protocols, checked
with ``isinstance``): the worker uses what an engine has and asks nothing else of it. A new engine
is one module with an ``Engine`` and one row in ``ocrq.engine_registry``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from PIL import Image

from ocrq.errors import OcrqError
from ocrq.results import OcrOutput
from worker.memory.costs import ImageCost, MemorySample, ModelProfile

__all__ = ["Capacity", "ConcurrentBatches", "Engine", "ImageCost", "KvCapacity", "KvGated", "MemorySample",
           "OcrRequest", "Profiled", "RendersAhead", "ReportsStats", "StartsInPhases"]


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


# --- capabilities ------------------------------------------------------------------------------


@runtime_checkable
class Profiled(Protocol):
    """The governor plans its device memory with a model's costs (without: the nominal CPU costs,
    which measured peaks then recalibrate)."""

    @property
    def memory_profile(self) -> ModelProfile: ...


@runtime_checkable
class Capacity(Protocol):
    #: device bytes the engine may claim (vLLM: its utilization share); None until started
    capacity_bytes: int | None


@runtime_checkable
class KvCapacity(Protocol):
    #: tokens the engine's KV cache holds; None until started or unknown
    kv_capacity_tokens: int | None


@runtime_checkable
class KvGated(Protocol):
    @property
    def kv_gated(self) -> bool:
        """Requests enter through a KV gate: the governor may book more than the cache holds."""
        ...


@runtime_checkable
class ConcurrentBatches(Protocol):
    #: micro-batches the engine loop may keep in flight at once (1: each drains before the next)
    concurrent_batches: int


@runtime_checkable
class RendersAhead(Protocol):
    def prepare(self, requests: Sequence[OcrRequest]) -> None:
        """CPU-side work on queued images ahead of their batch (advisory: a batch does what is missing)."""
        ...

    def discard(self, requests: Sequence[OcrRequest]) -> None:
        """Queued images that will not run (cancelled): forget what ``prepare`` made for them."""
        ...


@runtime_checkable
class ReportsStats(Protocol):
    def stats(self) -> Mapping[str, Any]:
        """Where the engine's time goes (shown in the worker's state)."""
        ...


@runtime_checkable
class StartsInPhases(Protocol):
    #: seconds of ``start()``'s critical path by phase ("import", "llm", "after_llm")
    start_phases: dict[str, float]
    #: seconds of work ``start()`` ran beside its critical path, by name
    start_beside: dict[str, float]
    #: callables ``start()`` runs while the engine builds (the worker adds its own: the clients)
    while_building: list[Callable[[], object]]
