"""What the commands share: the console (stderr), settings and client per command, the job
handle, and the counts, progress and results they print."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ocrq.settings import Settings, load_settings

# soft_wrap: a long path or URL stays on one line (copied whole), not broken at 80 columns
console = Console(stderr=True, soft_wrap=True)


def command_settings() -> Settings:
    s = load_settings()
    logging.basicConfig(level=s.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return s


def make_client(settings: Settings) -> Any:
    from producer.client import Client

    return Client(settings)


def images(n: int) -> str:
    return f"{n} image" + ("" if n == 1 else "s")


def job_handle(client: Any, job: str) -> Any:
    from producer.job import UnknownJob

    try:
        return client.job(job)
    except UnknownJob as exc:
        console.print(f"[red]no such job[/]: {escape(job)} (`ocrq jobs` lists the known ones)")
        raise typer.Exit(code=1) from exc


def print_counts(job: str, counts: dict[str, int], elapsed: float | None = None, published: int = 0) -> None:
    table = Table(title=f"job {job}")
    cols = ("total", "done", "cached", "failed", "queued", "running", "retrying")
    for col in cols:
        table.add_column(col, justify="right")
    table.add_row(*(str(counts.get(c, 0)) for c in cols))
    console.print(table)
    if elapsed and published:  # this run's images: a re-submit's earlier ones are not its work
        console.print(f"{images(published)} in {elapsed:.1f}s = {published / elapsed:.2f} img/s, "
                      f"{counts['cached']} cache hits in the job")


def print_submitted(job: str, handle: Any, took: float, republish: bool) -> None:
    """What the submit added to the job, or why it added nothing."""
    counts = handle.status()
    open_ = counts["total"] - counts["done"] - counts["failed"]
    if republish and handle.resumed:
        console.print(f"job [bold]{job}[/]: {images(handle.published)} sent again in {took:.2f}s")
    elif handle.published:
        console.print(f"job [bold]{job}[/]: {images(handle.published)} submitted in {took:.2f}s")
    elif not open_:
        console.print(f"job [bold]{job}[/]: 0 images submitted: every accepted image already finished in this job")
    else:
        console.print(f"job [bold]{job}[/]: 0 images submitted: every accepted image is already in this job, "
                      f"{images(open_)} of it not final yet (the workers go on"
                      + ("; after Redis lost data, `--republish` sends them again)" if handle.resumed else ")"))


def wait_progress(handle: Any, timeout: float | None) -> dict[str, int]:
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("done {task.fields[done]} · cached {task.fields[cached]} · failed {task.fields[failed]}"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        tid = bar.add_task(handle.name, total=None, done=0, cached=0, failed=0)

        def show(c: dict[str, int]) -> None:
            bar.update(tid, total=c["total"], completed=c["done"] + c["failed"],
                       done=c["done"], cached=c["cached"], failed=c["failed"])

        return dict(handle.wait(timeout=timeout, on_progress=show))


def write_results(handle: Any, out: Path) -> int:
    from ocrq.results import json_line

    n = 0
    with out.open("wb") as fh:
        for result in handle.results():
            fh.write(json_line(result.to_line()) + b"\n")
            n += 1
    return n


def print_failed(client: Any, job: str, failed: int, shown: int = 10) -> None:
    """Which images failed and why (the first ``shown``), and where the rest are."""
    from ocrq.failed import registered

    for entry in registered(client.index, client.store, job, limit=shown):
        console.print(f"  [red]failed[/] {escape(entry.record.ref)}: {escape(entry.why())}")
    more = f" (first {shown} above)" if failed > shown else ""
    console.print(f"  [bold]hint[/]: `ocrq failed --job {job}` lists the {images(failed)} that failed{more};"
                  f" `ocrq reprocess --job {job}` runs them again once fixed")
