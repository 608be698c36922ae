"""What enters the engine loop (``worker.loop.engine_loop``): images announced while the worker still
fetches and decodes them (``Intake``), images queued with the future their result completes
(``QueuedImage``), and completing such a future exactly once (``settle``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from ocrq.errors import EngineCrashed, OcrqError
from ocrq.results import OcrOutput
from worker.engines.base import ImageCost, OcrRequest

__all__ = ["Intake", "QueuedImage", "settle"]


class Intake:
    """Images announced to the engine loop while they are fetched and decoded; ``close`` (once,
    after they were submitted or dropped) withdraws them and reports how long that took
    (``arrived(images, seconds)``). A context manager."""

    def __init__(self, arrived: Callable[[int, float], None], images: int) -> None:
        self._arrived, self._images = arrived, images
        self._since = time.monotonic()

    def close(self) -> None:
        images, self._images = self._images, 0
        if images:
            self._arrived(images, time.monotonic() - self._since)

    def __enter__(self) -> Intake:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@dataclass(eq=False)
class QueuedImage:
    request: OcrRequest
    future: Future[OcrOutput]
    cost: ImageCost
    enqueued: float
    #: times a later image was taken before this one (the governor pins it after a few)
    skips: int = 0


def settle(future: Future[OcrOutput], outcome: object) -> None:
    """Complete a future once; later attempts (stop() racing the loop) are ignored."""
    if future.done():
        return
    try:
        if isinstance(outcome, OcrOutput):
            future.set_result(outcome)
        elif isinstance(outcome, OcrqError):
            future.set_exception(outcome)
        else:
            future.set_exception(EngineCrashed(f"engine returned {type(outcome).__name__}, not a result"))
    except InvalidStateError:
        pass
