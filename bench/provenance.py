"""The header table every bench doc opens with: when, which code, which machine, which command."""

from __future__ import annotations

import time

from bench import manifest


def commit() -> str:
    """The short hash of the code measured (the manifest's: HEAD, or ``OCRQ_COMMIT`` in a copy
    without .git), or ``unknown``."""
    return (manifest.commit()["commit"] or "unknown")[:7]


def header(machine: str, command: str, *, date: str | None = None, code: str | None = None) -> str:
    """``| measured | code | machine | reproduce |`` with one row, as docs/bench/overhead.md opens."""
    return ("| measured | code | machine | reproduce |\n|---|---|---|---|\n"
            f"| {date or time.strftime('%Y-%m-%d')} | commit `{code or commit()}` | {machine} | `{command}` |\n")
