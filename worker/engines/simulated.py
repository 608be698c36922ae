"""A simulated engine: the real engine loop and governor run on a CPU against it.

Shipped (not a test fake) so integration tests and bench dry-runs exercise batching, OOM handling
and calibration without a GPU. Its memory model is the ground truth the governor must learn:

    peak = weights + fixed + coef · tokens      (tokens = Σ per image, or n · max when padded)

with ``coef`` deliberately different from the prior it advertises in ``memory_profile``. A batch
whose peak exceeds ``capacity_bytes`` raises ``EngineOOM`` (or, with ``raw_oom``, a torch-style
``OutOfMemoryError``). ``paged`` mode behaves like vLLM instead: no OOM, KV usage and preemption
counters. The text is a digest of the pixels and the task, so an image's output never depends on
its batch (what the batch-invariance tests assert of every engine).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Sequence
from typing import Any

from ocrq.engine_settings import SimulatedSettings
from ocrq.errors import BadImage, EngineOOM, OcrqError
from ocrq.results import OcrLine, OcrOutput
from worker.engines.base import ImageCost, MemorySample, OcrRequest
from worker.memory.costs import MAX_PIXELS, MIN_PIXELS, ModelProfile, hunyuan_vision_tokens


class OutOfMemoryError(RuntimeError):
    """Mimics ``torch.OutOfMemoryError`` (same class name, same message) without torch."""


class SimulatedEngine:
    name = "simulated"

    def __init__(
        self,
        *,
        capacity_bytes: int,
        weight_bytes: int = 2_000_000_000,
        bytes_per_token: float = 115_600.0,
        fixed_bytes: int = 0,
        prior_scale: float = 1.0,
        prompt_tokens: int = 16,
        output_tokens: int = 256,
        min_pixels: int = MIN_PIXELS,
        max_pixels: int = MAX_PIXELS,
        padded: bool = False,
        noise: float = 0.0,
        seed: int | None = 0,
        transient_ooms: int = 0,
        oom_rate: float = 0.0,
        raw_oom: bool = False,
        crashes: int = 0,
        paged: bool = False,
        bad_keys: Sequence[str] = (),
        batch_latency_s: float = 0.0,
        image_latency_s: float = 0.0,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.weight_bytes = weight_bytes
        self.bytes_per_token = bytes_per_token
        self.fixed_bytes = fixed_bytes
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.padded = padded
        self.noise = noise
        self.paged = paged
        self.raw_oom = raw_oom
        #: fraction of batches that raise a transient CUDA-style OOM (an OOM storm)
        self.oom_rate = oom_rate
        self.bad_keys = frozenset(bad_keys)
        self.batch_latency_s = batch_latency_s
        self.image_latency_s = image_latency_s
        #: the prior the governor starts from: the true coefficient scaled by ``prior_scale``
        self.memory_profile = ModelProfile(
            name="simulated", weight_bytes=weight_bytes, kv_bytes_per_token=0,
            act_bytes_per_token=bytes_per_token * prior_scale, padded=padded,
        )
        #: keys of every batch ``infer`` was called with, OOMed ones included
        self.batches: list[list[str]] = []
        #: true peak of every batch that ran (None for paged mode)
        self.peaks: list[int] = []
        self._transient_left = transient_ooms
        self._crashes_left = crashes
        # None: fresh OS entropy, so engine processes (a restarted worker too) don't all replay
        # one fault sequence
        self._rng = random.Random(seed)
        self._peak: int | None = None
        self._kv_usage: float | None = None
        self._preemptions = 0

    @classmethod
    def from_settings(cls, settings: SimulatedSettings) -> SimulatedEngine:
        """HunyuanOCR-like defaults on a 24 GiB device; ``settings.extra`` overrides any
        constructor argument (e.g. ``{"capacity_bytes": 80e9, "transient_ooms": 2}``)."""
        kwargs: dict[str, Any] = {
            "capacity_bytes": 24 * 2**30,
            "min_pixels": settings.min_pixels,
            "max_pixels": settings.max_pixels,
            "output_tokens": settings.max_new_tokens,
            "prior_scale": 1.06,
        }
        kwargs.update(settings.extra)
        for key in ("capacity_bytes", "weight_bytes", "fixed_bytes"):
            if key in kwargs:
                kwargs[key] = int(kwargs[key])
        return cls(**kwargs)

    @property
    def revision(self) -> str:
        return "simulated-1"

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def cost(self, request: OcrRequest) -> ImageCost:
        width, height = request.image.size
        vision = hunyuan_vision_tokens(width, height, self.min_pixels, self.max_pixels)
        output = int(request.params.get("max_new_tokens", self.output_tokens))
        return ImageCost(vision_tokens=vision, prompt_tokens=self.prompt_tokens, output_tokens=output)

    def true_peak(self, costs: Sequence[ImageCost]) -> float:
        """The peak this batch needs, before noise (tests compare the governor against it)."""
        tokens = [c.total_tokens for c in costs]
        held = len(tokens) * max(tokens) if self.padded and tokens else sum(tokens)
        return self.weight_bytes + self.fixed_bytes + self.bytes_per_token * held

    def infer(self, batch: Sequence[OcrRequest]) -> list[OcrOutput | OcrqError]:
        self.batches.append([r.key for r in batch])
        if self._crashes_left > 0:
            self._crashes_left -= 1
            raise RuntimeError("simulated engine crash (not a memory problem)")
        costs = [self.cost(r) for r in batch]
        need = self.true_peak(costs)
        need *= 1.0 + self.noise * (2.0 * self._rng.random() - 1.0)
        if self._transient_left > 0:
            self._transient_left -= 1
            self._oom(need, transient=True)
        if self.oom_rate and self._rng.random() < self.oom_rate:
            self._oom(need, transient=True)
        if self.paged:
            pool = max(1.0, self.capacity_bytes - self.weight_bytes)
            self._kv_usage = min(1.0, (need - self.weight_bytes) / pool)
            self._preemptions += int(need > self.capacity_bytes)
        elif need > self.capacity_bytes:
            self._peak = self.capacity_bytes
            self._oom(need, transient=False)
        else:
            self._peak = int(need)
            self.peaks.append(int(need))
        if self.batch_latency_s or self.image_latency_s:
            time.sleep(self.batch_latency_s + self.image_latency_s * len(batch))
        return [self._output(r, c.vision_tokens) for r, c in zip(batch, costs, strict=True)]

    def _oom(self, need: float, *, transient: bool) -> None:
        message = (
            f"CUDA out of memory. Tried to allocate {need / 2**20:.0f} MiB "
            f"({'simulated transient' if transient else 'simulated'}; capacity {self.capacity_bytes} B)"
        )
        if self.raw_oom:
            raise OutOfMemoryError(message)
        raise EngineOOM(message)

    def _output(self, request: OcrRequest, vision_tokens: int) -> OcrOutput | OcrqError:
        if request.key in self.bad_keys:
            return BadImage(f"{request.key}: simulated undecodable image")
        image = request.image
        digest = hashlib.sha256()
        digest.update(f"{image.mode}:{image.size}:{request.task}:{sorted(request.params.items())}".encode())
        digest.update(image.tobytes())
        text = f"sim:{digest.hexdigest()[:16]}"
        w, h = image.size
        box = [[0.0, 0.0], [float(w), 0.0], [float(w), float(h)], [0.0, float(h)]]
        return OcrOutput(
            text=text, lines=[OcrLine(text=text, box=box, confidence=1.0)], engine=self.name,
            model=self.revision, width=w, height=h, meta={"vision_tokens": vision_tokens},
        )

    def memory(self) -> MemorySample:
        if self.paged:
            return MemorySample(kv_usage=self._kv_usage, waiting=0, preemptions=self._preemptions)
        return MemorySample(allocated=self.weight_bytes, reserved=self.weight_bytes, peak=self._peak)

    def reset_peak(self) -> None:
        self._peak = None
        self._kv_usage = None

