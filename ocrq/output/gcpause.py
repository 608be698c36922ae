"""Python's cyclic collector held off while a batch of stored documents is parsed (not while
they are read: a pause is process-wide, and a slow read would hold it for every thread).

Parsing 512 result documents and their records creates ~12,000 objects the collector tracks
(measured, documents of one line each), and they all survive (the caller keeps them), so
the collector runs its young collections over and over and promotes them, and every full
collection walks whatever the process already holds: most of a result's parse time was the
collector's (ImageResult: 12 µs with the collector off, 39-41 µs on, measured in a process that
kept its results). The models hold no reference cycles, so there is nothing for it to find there.

Process-wide and not counted: a thread that finds the collector already off leaves it to the one
that turned it off, which turns it back on; it is never left off, and a process that turned it off
itself keeps it off.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused"]


@contextmanager
def paused() -> Iterator[None]:
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
