"""Following a job from the command line until every image is final: on a terminal a bar with
per-image counts, img/s and ETA redrawn twice a second (rich); otherwise a plain line when the
count moved (at most every ``PLAIN_EVERY_S``, and at least every ``PLAIN_QUIET_S``) and a last
one. The numbers are ``producer.progress``'s."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ocrq_cli.common import console, images
from producer.errors import WaitTimedOut
from producer.progress import JobProgress, job_progress

#: seconds between plain lines while the count moves, and at most between two lines
PLAIN_EVERY_S = 5.0
PLAIN_QUIET_S = 30.0


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def line(p: JobProgress, what: str = "images") -> str:
    c = p.counts
    pace = (f"{p.avg_img_per_s:.2f} img/s over {duration(p.elapsed_s)}" if p.complete
            else f"{p.img_per_s:.1f} img/s · ETA {duration(p.eta_s)}")
    return (f"job {p.job}: {p.finished:,}/{p.total:,} {what} · done {c.get('done', 0):,} · cached "
            f"{c.get('cached', 0):,} · failed {c.get('failed', 0):,} · {pace}")


def follow(client: Any, job: str, timeout: float | None = None, poll: float = 0.5, what: str = "images",
           done: Callable[[JobProgress], bool] | None = None) -> JobProgress:
    """Poll ``job`` until every image is final (and ``done(progress)``, if given), showing its
    progress; ``WaitTimedOut`` after ``timeout`` seconds (the job goes on)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    finished = done or (lambda p: True)

    def snapshot() -> JobProgress:
        return job_progress(client.redis, client.index, job)

    def over(p: JobProgress) -> bool:
        return p.complete and not client.job(job).submitting() and finished(p)

    if console.is_terminal:
        return _live(snapshot, over, deadline, poll, job, timeout, what)
    return _plain(snapshot, over, deadline, poll, job, timeout, what)


def _timed_out(p: JobProgress, timeout: float | None) -> WaitTimedOut:
    c = p.counts
    return WaitTimedOut(
        f"timed out after {timeout:g}s: {p.final:,} of {images(p.total)} final in job {p.job} (queued "
        f"{c.get('queued', 0):,}, running {c.get('running', 0):,}, retrying {c.get('retrying', 0):,}). The job "
        f"goes on: `ocrq status {p.job}` follows it, `ocrq export {p.job} --wait` waits for its export")


def _live(snapshot: Callable[[], JobProgress], over: Callable[[JobProgress], bool], deadline: float | None,
          poll: float, job: str, timeout: float | None, what: str) -> JobProgress:
    columns = (TextColumn("[bold]{task.description}"), BarColumn(),
               TextColumn("{task.completed:,.0f}/{task.total:,.0f} " + what),
               TextColumn("· done {task.fields[done]:,} · cached {task.fields[cached]:,} · "
                          "failed {task.fields[failed]:,}"),
               TextColumn("· {task.fields[rate]:.1f} img/s · ETA {task.fields[eta]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, refresh_per_second=4) as bar:
        tid = bar.add_task(job, total=1, done=0, cached=0, failed=0, rate=0.0, eta="–")
        while True:
            p = snapshot()
            c = p.counts
            bar.update(tid, total=max(p.total, 1), completed=p.finished, done=c.get("done", 0),
                       cached=c.get("cached", 0), failed=c.get("failed", 0), rate=p.img_per_s, eta=duration(p.eta_s))
            if over(p):
                return p
            if deadline is not None and time.monotonic() > deadline:
                raise _timed_out(p, timeout)
            time.sleep(poll)


def _plain(snapshot: Callable[[], JobProgress], over: Callable[[JobProgress], bool], deadline: float | None,
           poll: float, job: str, timeout: float | None, what: str) -> JobProgress:
    shown, at = -1, 0.0
    while True:
        p = snapshot()
        now = time.monotonic()
        moved, end = p.finished != shown, over(p)
        if (moved and now - at >= PLAIN_EVERY_S) or now - at >= PLAIN_QUIET_S or (end and moved):
            console.print(line(p, what), markup=False, highlight=False)
            shown, at = p.finished, now
        if end:
            return p
        if deadline is not None and now > deadline:
            raise _timed_out(p, timeout)
        time.sleep(poll)
