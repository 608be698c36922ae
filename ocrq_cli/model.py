"""``ocrq model``: model checkpoints (a random-weight HunyuanOCR for tests and benchmarks)."""

from __future__ import annotations

from pathlib import Path

import typer

from ocrq_cli.common import (
    console,
)

model_app = typer.Typer(no_args_is_help=True, help="Model checkpoints.")


@model_app.command("make-random")
def make_random(size: str = typer.Option("tiny", help="tiny | full"),
                out: Path = typer.Option(..., "--out", "-o"), seed: int = 0) -> None:
    """Write a random-weight HunyuanOCR-1.5 checkpoint (tests and benchmarks; no download)."""
    from worker.checkpoint import make_random_checkpoint

    path = make_random_checkpoint(out, size=size, seed=seed)  # type: ignore[arg-type]
    console.print(f"wrote {path}")
