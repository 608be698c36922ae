"""How many images a worker must hold so its engine never waits for intake (Little's law).

An image spends some time in intake (fetched, hashed, checked against the cache, decoded) before
the engine loop sees it. To keep an engine that reads ``rate`` images a second busy, a worker
must therefore hold ``rate × intake seconds`` images in intake at any time, on top of what the
engine is running. For a slow engine (a GPU page takes ~0.1 s) that is a handful of images and
the governor's backlog of two batches is the larger number; for a cheap one (the simulated
engine reads thousands of images a second) it is several chunks, and a window of the governor's
backlog alone (one chunk with fixed batches of 4) left the engine and the chunk threads waiting
for the broker between chunks (docs/bench/overhead.md).

Both numbers are moving averages of what the engine loop saw: each batch's images over its
engine seconds (times the batches that may run at once), each chunk's time from its arrival to
its hand-off to the engine. Before the first of either, the term is 0 (the governor decides).
"""

from __future__ import annotations

import math
import threading

#: weight of the newest observation in each moving average
_ALPHA = 0.2


class Pace:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: images a second the engine reads when busy (0: no batch seen yet)
        self._rate = 0.0
        #: seconds a chunk spends in intake (0: none seen yet)
        self._intake_s = 0.0

    def batch(self, images: int, seconds: float, slots: int = 1) -> None:
        """A batch of ``images`` took ``seconds`` of engine time; ``slots`` such run at once."""
        if images <= 0 or seconds <= 0:
            return
        with self._lock:
            self._rate = _ewma(self._rate, slots * images / seconds)

    def intake(self, seconds: float) -> None:
        """A chunk's images reached the engine loop (or turned out not to need it) after ``seconds``."""
        if seconds < 0:
            return
        with self._lock:
            self._intake_s = _ewma(self._intake_s, seconds)

    def backlog(self) -> int:
        """Images that must be in intake to keep the engine busy: rate × intake seconds."""
        with self._lock:
            return math.ceil(self._rate * self._intake_s)

    def state(self) -> dict[str, float]:
        with self._lock:
            return {"engine_img_s": round(self._rate, 1), "intake_s": round(self._intake_s, 4)}


def _ewma(current: float, sample: float) -> float:
    return sample if current == 0 else (1 - _ALPHA) * current + _ALPHA * sample
