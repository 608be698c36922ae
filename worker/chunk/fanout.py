"""Spread a chunk's per-image work (fetch + hash, decode) over the fetch pool in a few groups.

One future per image costs more than reading and hashing a small local file (a Future, a
Condition and a queue hand-off each, under the GIL: docs/bench/overhead.md); one future per
group of images keeps the same parallelism for slow remote refs (at most ``threads`` at once, as
before) at a fraction of the cost. Each image gets its own outcome: a result or the exception
it raised, so one bad image never hides the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def fan_out(pool: Executor, threads: int, fn: Callable[[T], R], items: Sequence[T]) -> list[R | Exception]:
    """``fn(item)`` for every item, in at most ``threads`` groups run in ``pool``; outcomes in
    item order (the exception instead of a result where ``fn`` raised)."""
    if not items:
        return []
    groups = max(1, min(threads, len(items)))

    def run(group: Sequence[T]) -> list[R | Exception]:
        out: list[R | Exception] = []
        for item in group:
            try:
                out.append(fn(item))
            except Exception as exc:  # handed back per item; the caller classifies it
                out.append(exc)
        return out

    futures = [pool.submit(run, items[g::groups]) for g in range(groups)]
    parts = [f.result() for f in futures]
    # items[g::groups] interleaves; put the outcomes back in item order
    outcomes: list[R | Exception] = [None] * len(items)  # type: ignore[list-item]
    for g, part in enumerate(parts):
        outcomes[g::groups] = part
    return outcomes
