"""A worker's start, phase by phase: where the seconds from ``exec`` to the first message go.

Phases on the critical path, in order (each the wall time since the previous mark):

    interpreter  process start → ``run_worker`` (Python, ocrq's and Celery's imports, settings)
    celery       the Celery app, tasks and consumer steps, up to Celery's ``worker_init``
    engine       the engine's start (``Engine.start``); the engine may break it down further
                 (``engine.<name>``: vLLM's import, ``LLM()``, its weights, compile, CUDA graphs …
                 from its own log lines, and what waited for the warm-up after ``LLM()``)
    governor     the memory probe and the governor (restored from its saved snapshot)
    services     the engine loop and the submission feeder
    gc           one full collection, then everything alive frozen out of the collector's reach
    consumer     Celery's consumer: broker connection, queues, the prefetch and reaper steps

Phases *beside* the critical path run while another one does (``beside``): the clients (Redis,
store, S3, the decoder processes, metrics) while the engine builds, and inside the engine the
renderer's warm-up, the answer tokenizer, the first garbage collection and (vLLM) the clients
while its core builds; a ``clients`` phase on the path means the core was ready first. They cost
CPU, not wall time, as long as they end first. ``critical_path`` lists the phases, the engine's
own broken down, whose seconds add up to ``ready_s``.

``ready_s`` is what KEDA or a replaced spot GPU pays before the worker takes work. The breakdown
goes to the log (one line), the worker's state in Redis (``start``) and its metrics
(``ocrq_worker_start_seconds{phase}``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def process_started_at() -> float:
    """This process's start (epoch seconds) from /proc; now where /proc is not there."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: field 22, counted from after "(comm)"
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class StartupClock:
    """Marks phases as they end; ``clock`` is injectable for tests."""

    def __init__(self, started_at: float | None = None, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.started_at = process_started_at() if started_at is None else started_at
        self._last = self.started_at
        self.phases: dict[str, float] = {}
        self.detail: dict[str, float] = {}
        #: phase → (seconds, the critical-path phase it ran beside)
        self.beside: dict[str, tuple[float, str]] = {}
        #: sub-phases of a critical-path phase that follow one another (the rest of its detail ran beside)
        self._path_detail: dict[str, list[str]] = {}
        self.ready_s: float | None = None

    def mark(self, phase: str) -> float:
        """End ``phase`` now; returns its seconds."""
        now = self._clock()
        seconds = max(0.0, now - self._last)
        self.phases[phase] = round(self.phases.get(phase, 0.0) + seconds, 3)
        self._last = now
        return seconds

    def add_detail(self, parent: str, parts: dict[str, float], path: list[str] | None = None) -> None:
        """Sub-phases a component measured itself (already inside ``parent``'s seconds); ``path``
        names those that follow one another on the critical path (in order)."""
        for name, seconds in parts.items():
            self.detail[f"{parent}.{name}"] = round(float(seconds), 3)
        if path is not None:
            self._path_detail[parent] = [name for name in path if name in parts]

    def add_beside(self, phase: str, seconds: float, during: str) -> None:
        """A phase that ran while ``during`` (a critical-path phase) did: it took no wall time of its own."""
        self.beside[phase] = (round(float(seconds), 3), during)

    def critical_path(self) -> list[tuple[str, float]]:
        """(phase, seconds) in order, adding up to ``ready_s``: the phases marked, each broken down
        into the sub-phases that follow one another where the component said which (the remainder
        of such a phase is ``<phase>.other``)."""
        path: list[tuple[str, float]] = []
        for phase, seconds in self.phases.items():
            parts = self._path_detail.get(phase)
            if not parts:
                path.append((phase, seconds))
                continue
            inside = [(f"{phase}.{name}", self.detail[f"{phase}.{name}"]) for name in parts]
            path.extend(inside)
            path.append((f"{phase}.other", round(max(0.0, seconds - sum(s for _, s in inside)), 3)))
        return path

    def ready(self) -> float:
        """The worker takes work from now: the last phase ends."""
        self.mark("consumer")
        self.ready_s = round(self._last - self.started_at, 3)
        return self.ready_s

    def state(self) -> dict[str, object]:
        return {"ready_s": self.ready_s, "phases": dict(self.phases), "detail": dict(self.detail),
                "beside": {name: {"s": s, "during": during} for name, (s, during) in self.beside.items()},
                "critical_path": [[name, s] for name, s in self.critical_path()]}

    def summary(self) -> str:
        parts = [f"{name} {seconds:.1f}s" for name, seconds in self.phases.items()]
        detail = [f"{name} {seconds:.1f}s" for name, seconds in self.detail.items()]
        line = f"ready in {self.ready_s if self.ready_s is not None else float('nan'):.1f}s: " + ", ".join(parts)
        line += f" ({', '.join(detail)})" if detail else ""
        if self.beside:
            line += "; beside: " + ", ".join(f"{name} {s:.1f}s during {during}"
                                             for name, (s, during) in self.beside.items())
        path = [f"{name} {s:.1f}s" for name, s in self.critical_path() if s >= 0.05]
        return line + "; critical path: " + " > ".join(path)
