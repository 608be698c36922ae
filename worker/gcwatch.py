"""Python's cyclic garbage collector, watched: how often a full (generation 2) collection ran in
this process and how long it held the interpreter.

A worker that hosts vLLM keeps millions of long-lived objects (vLLM, torch, transformers); every
full collection walks all of them while holding the GIL, so the render threads and Celery's
threads stop meanwhile. ``freeze`` (``gc.freeze`` after the engine is built) moves what exists
then into the permanent generation, which collections skip. The counters go into the worker state
(``gc``), so a row of the benchmark shows what the collector cost.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

_lock = threading.Lock()
_stats = {"full": 0, "full_s": 0.0, "young": 0, "young_s": 0.0, "frozen": 0}
_started: dict[int, float] = {}  # thread id → start of the collection it runs
_installed = False


def _callback(phase: str, info: dict[str, Any]) -> None:
    tid = threading.get_ident()
    if phase == "start":
        _started[tid] = time.perf_counter()
        return
    t0 = _started.pop(tid, None)
    if t0 is None:
        return
    seconds = time.perf_counter() - t0
    kind = "full" if info.get("generation") == 2 else "young"
    with _lock:
        _stats[kind] += 1
        _stats[f"{kind}_s"] += seconds


def install() -> None:
    """Start counting (idempotent)."""
    global _installed
    if not _installed:
        gc.callbacks.append(_callback)
        _installed = True


def freeze() -> int:
    """Collect once, then move every object alive now out of the collector's reach; returns how
    many objects are frozen."""
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    with _lock:
        _stats["frozen"] = count
    return count


def snapshot() -> dict[str, Any]:
    with _lock:
        out = dict(_stats)
    out["full_s"] = round(out["full_s"], 3)
    out["young_s"] = round(out["young_s"], 3)
    return out
