"""What the commands share: the console (stderr), settings and client per command, the job
handle, and the counts, progress and results they print."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ocrq.settings import Settings, load_settings

# soft_wrap: a long path or URL stays on one line (copied whole), not broken at 80 columns
console = Console(stderr=True, soft_wrap=True)


#: ``debug``: set by ``ocrq --debug`` (errors then show their traceback too); ``redis_url``: the
#: Redis this command talks to (named when it goes away mid-command)
STATE: dict[str, Any] = {"debug": False, "redis_url": None}


def command_settings() -> Settings:
    """The process's settings (``SettingsError``, one line per problem: ``ocrq_cli.main`` prints it)."""
    s = load_settings()
    STATE["redis_url"] = s.redis.url
    logging.basicConfig(level=s.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return s


def make_client(settings: Settings) -> Any:
    """The producer client, once Redis answered (``Unreachable`` within 3 s otherwise)."""
    from producer.client import Client

    client = Client(settings)
    client.check_reachable()
    return client


def images(n: int) -> str:
    return f"{n:,} image" + ("" if n == 1 else "s")


def job_handle(client: Any, job: str) -> Any:
    """The job's handle (``UnknownJob``: exit 1, ``ocrq_cli.main``)."""
    return client.job(job)


def counts_table(title: str, counts: dict[str, int], skipped: int | None = None) -> Table:
    """Every status of the README (``ImageStatus``), then cached (and skipped, when known)."""
    from ocrq.results import ImageStatus

    table = Table(title=title)
    cols = ["total", *[s.value for s in ImageStatus], "cached"]
    values = [counts.get(c, 0) for c in cols]
    if skipped is not None:
        cols.append("skipped")
        values.append(skipped)
    for col in cols:
        table.add_column(col, justify="right")
    table.add_row(*(f"{v:,}" for v in values))
    return table


def print_counts(job: str, counts: dict[str, int], elapsed: float | None = None, published: int = 0) -> None:
    console.print(counts_table(f"job {job}", counts))
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


def write_results(handle: Any, out: Path) -> int:
    from ocrq.results import json_line

    n = 0
    with out.open("wb") as fh:
        for result in handle.results():
            fh.write(json_line(result.to_line()) + b"\n")
            n += 1
    return n


def print_failed(client: Any, job: str, failed: int, shown: int = 10, ids: set[str] | None = None) -> None:
    """Which images failed and why (the first ``shown``; of ``ids`` only, when given), and where
    the rest are."""
    from ocrq.jobs.failed import registered

    listed = 0
    for entry in registered(client.index, client.store, job, limit=None if ids is not None else shown):
        if ids is not None and entry.record.id not in ids:
            continue
        console.print(f"  [red]failed[/] {escape(entry.record.ref)}: {escape(entry.why())}")
        listed += 1
        if listed >= shown:
            break
    more = f" (first {shown} above)" if failed > shown else ""
    console.print(f"  [bold]hint[/]: `ocrq failed --job {job}` lists the {images(failed)} that failed{more};"
                  f" `ocrq reprocess --job {job}` runs them again once fixed")


def outcome(client: Any, job: str, counts: dict[str, int], failed: int | None = None,
            ids: set[str] | None = None, what: str = "images") -> None:
    """The end of a wait: ``ImagesFailed`` (exit 3) after naming the first ten failures and why,
    when any failed (``failed``: of the images waited for, default the job's)."""
    from producer.errors import ImagesFailed

    failed = counts.get("failed", 0) if failed is None else failed
    if failed:
        print_failed(client, job, failed, ids=ids)
        raise ImagesFailed(job, failed, counts.get("total", 0) if ids is None else len(ids), what)
