"""vLLM's engine build, phase by phase, read from vLLM's own log lines.

The engine core builds in its own process, so its timings never reach ours as values: vLLM logs
them ("Loading weights took …", "torch.compile took …", "Graph capturing finished in …").
The plugin (``plugin.register``, run in every vLLM process) installs :class:`PhaseLog` on the
``vllm`` logger when ``OCRQ_VLLM_START_LOG`` names a file; each matching line appends one JSON
line there, and the engine reads the file back once ``LLM()`` returns. Lines that a vLLM release
words differently are simply missing from the breakdown, never an error.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

ENV = "OCRQ_VLLM_START_LOG"

#: phase -> the message that carries its seconds (first group), as vLLM 0.26-0.32 word them
PATTERNS: dict[str, re.Pattern[str]] = {
    "weights": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "model_load": re.compile(r"Model loading took .*? and ([\d.]+) seconds"),
    "dynamo": re.compile(r"Dynamo bytecode transform time: ([\d.]+) s"),
    "compile": re.compile(r"torch\.compile took ([\d.]+) s in total"),
    "profile": re.compile(r"Memory profiling takes ([\d.]+) seconds"),
    "warmup": re.compile(r"Initial profiling/warmup run took ([\d.]+) s"),
    "cuda_graphs": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "init_engine": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
}


def parse(message: str) -> tuple[str, float] | None:
    for phase, pattern in PATTERNS.items():
        m = pattern.search(message)
        if m:
            return phase, float(m.group(1))
    return None


class PhaseLog(logging.Handler):
    """Appends ``{"phase", "s", "pid"}`` for each of vLLM's timing lines (any process)."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.INFO)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        try:
            found = parse(record.getMessage())
            if found is None:
                return
            line = json.dumps({"phase": found[0], "s": found[1], "pid": os.getpid()})
            with open(self.path, "a") as f:  # a few lines per build: open per line, no handle to leak
                f.write(line + "\n")
        except Exception:  # never let a timing line break vLLM's logging
            pass


def install_from_env() -> bool:
    """Install the handler in this process if the engine asked for it (idempotent)."""
    path = os.environ.get(ENV)
    if not path:
        return False
    logger = logging.getLogger("vllm")
    if any(isinstance(h, PhaseLog) and h.path == path for h in logger.handlers):
        return True
    from worker.engines.vllm import compat

    compat.keep_log_handler(PhaseLog(path))  # 0.32 replaces the logger's handlers later
    return True


def read(path: Path) -> dict[str, float]:
    """The phases found; a phase logged more than once (several compile ranges) is summed."""
    out: dict[str, float] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
            out[rec["phase"]] = round(out.get(rec["phase"], 0.0) + float(rec["s"]), 3)
        except (ValueError, KeyError, TypeError):
            continue
    return out
