"""Device out-of-memory: what the engine loop does when a batch runs out of memory.

OOM (``EngineOOM`` or a raw CUDA/HIP OOM, recognised without importing torch by
``ocrq.errors.is_oom``, re-exported here): the governor shrinks, the batch is bisected and the
halves run again, up to ``oom_retries`` levels, and images still failing are handed back as
retryable ``EngineOOM``. A lone image that runs out of memory is retried once more at full size
when the model says it fits (a transient OOM), then once downscaled (half its vision tokens,
aspect kept); if that fails too it is ``TooLargeForDevice``, or a retryable ``EngineOOM`` when
the model still says the downscaled image fits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from PIL import Image

from ocrq.errors import EngineOOM, OcrqError, TooLargeForDevice, classify, is_oom
from ocrq.results import OcrOutput
from worker.engines.base import Engine, ImageCost, OcrRequest
from worker.loop.intake import QueuedImage, settle

if TYPE_CHECKING:
    from worker.governor.governor import Governor

__all__ = ["OOM_LOG", "OomRecovery", "downscale_for_memory", "is_oom", "restore_scale"]

#: the start of the warning logged at every OOM (the chaos suite counts them in worker logs,
#: which survive a killed worker, unlike its published state)
OOM_LOG = "OOM on a batch of"


def downscale_for_memory(
    request: OcrRequest, cost: Callable[[OcrRequest], ImageCost]
) -> OcrRequest | None:
    """The request with its image shrunk (aspect kept) until it costs at most half the vision
    tokens; None when shrinking lowers nothing (the model upsamples to its minimum anyway).

    Tokens, not raw pixels: an image above the model's pixel cap is resized down by the model
    anyway, so halving its raw pixels alone would change nothing. Candidate sizes are priced on
    a 1-bit stand-in image; only the chosen size is resampled."""
    width, height = request.image.size
    before = cost(request).vision_tokens
    best: tuple[int, int] | None = None
    for step in range(1, 13):
        scale = 0.5 ** (step / 2)
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        tokens = cost(replace(request, image=Image.new("1", size))).vision_tokens
        if tokens < before and best is None:
            best = size
        if tokens <= before / 2:
            best = size
            break
        if size == (1, 1):
            break
    if best is None:
        return None
    return replace(request, image=request.image.resize(best, Image.Resampling.BICUBIC))


def restore_scale(output: OcrOutput, original: tuple[int, int], small: tuple[int, int]) -> OcrOutput:
    """Boxes back in the original image's pixels; the downscale recorded in meta."""
    fx, fy = original[0] / small[0], original[1] / small[1]
    lines = [
        ln.model_copy(update={"box": [[p[0] * fx, p[1] * fy] for p in ln.box]}) if ln.box else ln
        for ln in output.lines
    ]
    meta = {**output.meta, "downscaled_for_memory": {"from": list(original), "to": list(small)}}
    return output.model_copy(
        update={"lines": lines, "width": original[0], "height": original[1], "meta": meta}
    )


class OomRecovery:
    """The engine loop's recovery from a batch that ran out of device memory: bisect, retry a
    lone image, downscale it. Mixed into ``worker.loop.engine_loop.EngineLoop``, which runs batches
    (``_execute``, ``_infer``) and feeds the governor (``_learn``)."""

    engine: Engine
    governor: Governor
    log: logging.Logger
    oom_retries: int
    oom_backoff_s: float
    _stats: dict[str, int]

    def _execute(self, items: list[QueuedImage], depth: int) -> None:
        raise NotImplementedError

    def _infer(self, requests: Sequence[OcrRequest]) -> list[OcrOutput | OcrqError]:
        raise NotImplementedError

    def _learn(self, costs: list[ImageCost], *, grow: bool) -> None:
        raise NotImplementedError

    def _after_oom(self, items: list[QueuedImage], depth: int, exc: BaseException) -> None:
        self._stats["oom_events"] += 1
        self.governor.on_oom([it.cost for it in items])
        self.log.warning(OOM_LOG + " %d (level %d): %s", len(items), depth, exc)
        if len(items) == 1:
            self._retry_alone(items[0])
            return
        if depth >= self.oom_retries:
            error = EngineOOM(f"out of device memory in a batch of {len(items)} after {depth} bisections")
            for item in items:
                settle(item.future, error)
            return
        if self.oom_backoff_s > 0:
            time.sleep(min(1.0, self.oom_backoff_s * 2**depth))  # let the allocator/neighbours settle
        mid = len(items) // 2
        self._execute(items[:mid], depth + 1)
        self._execute(items[mid:], depth + 1)

    def _retry_alone(self, item: QueuedImage) -> None:
        """A lone image ran out of memory. If the model says it fits, the OOM was likely
        transient (a neighbour's spike, allocator fragmentation): one more try at full size.
        Then, or otherwise, one try downscaled."""
        if self.governor.fits([item.cost]):
            if self.oom_backoff_s > 0:
                time.sleep(min(1.0, self.oom_backoff_s * 2**self.oom_retries))
            try:
                outcome = self._infer([item.request])[0]
            except Exception as exc:
                if not is_oom(exc):
                    settle(item.future, classify(exc))
                    return
                self._stats["oom_events"] += 1
                self.governor.on_oom([item.cost])
            else:
                self._learn([item.cost], grow=False)
                settle(item.future, outcome)
                return
        self._retry_downscaled(item)

    def _retry_downscaled(self, item: QueuedImage) -> None:
        original = item.request.image.size
        too_large = TooLargeForDevice(
            f"{item.request.key}: {original[0]}x{original[1]} does not fit the device alone"
        )
        try:
            smaller = downscale_for_memory(item.request, self.engine.cost)
        except Exception as exc:
            self.log.warning("downscaling %s failed: %s", item.request.key, exc)
            smaller = None
        if smaller is None:
            self._stats["too_large"] += 1
            settle(item.future, too_large)
            return
        small = smaller.image.size
        cost = self.engine.cost(smaller)
        try:
            outcome = self._infer([smaller])[0]
        except Exception as exc:
            if not is_oom(exc):
                settle(item.future, classify(exc))
                return
            self._stats["oom_events"] += 1
            self.governor.on_oom([cost])
            if self.governor.fits([cost]):
                # the model says the downscaled image fits: the device is short right now
                settle(item.future, EngineOOM(f"{item.request.key}: out of device memory; retry later"))
            else:
                self._stats["too_large"] += 1
                settle(item.future, TooLargeForDevice(f"{too_large} (not at {small[0]}x{small[1]} either)"))
            return
        self._learn([cost], grow=False)
        self._stats["downscaled"] += 1
        self.log.info("%s ran downscaled %s -> %s to fit memory", item.request.key, original, small)
        settle(item.future, restore_scale(outcome, original, small) if isinstance(outcome, OcrOutput)
                else outcome)
