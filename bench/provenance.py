"""The header table every bench doc opens with: when, which code, which machine, which command."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The short hash of the checked-out commit (``git rev-parse --short HEAD``), or ``unknown``."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True, check=False)
    return out.stdout.strip() or "unknown"


def header(machine: str, command: str, *, date: str | None = None, code: str | None = None) -> str:
    """``| measured | code | machine | reproduce |`` with one row, as docs/bench/overhead.md opens."""
    return ("| measured | code | machine | reproduce |\n|---|---|---|---|\n"
            f"| {date or time.strftime('%Y-%m-%d')} | commit `{code or commit()}` | {machine} | `{command}` |\n")
