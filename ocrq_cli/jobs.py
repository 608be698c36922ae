"""The commands that follow jobs: ``status`` (counts, progress and cost), ``export``, ``results``,
``jobs`` and ``reprocess`` (failed images again)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from ocrq_cli.common import (
    command_settings,
    console,
    counts_table,
    images,
    job_handle,
    make_client,
    outcome,
    print_counts,
    print_failed,
    write_results,
)
from ocrq_cli.progress import duration, follow

_JSON_HELP = "JSON on stdout (the default when stdout is not a terminal)"


def _as_json(flag: bool) -> bool:
    return flag or not sys.stdout.isatty()


def status(job: str, as_json: bool = typer.Option(False, "--json", help=_JSON_HELP)) -> None:
    """Counts per status for JOB (every status, cached, skipped), its progress (img/s, ETA) and
    what it cost, named by what measured it: CPU-seconds on a CPU engine, GPU-seconds on a GPU
    (exit 1 if there is no such job). A table on a terminal, JSON when piped or with --json."""
    from ocrq.jobs.cost import job_cost
    from producer.progress import job_progress

    settings = command_settings()
    client = make_client(settings)
    handle = job_handle(client, job)
    progress = job_progress(client.redis, client.index, job)
    counts = progress.counts
    meta = client.index.meta(job)
    cost = job_cost(client.index, job, settings.gpu_hour_usd, settings.store.put_usd_per_1000,
                    settings.store.get_usd_per_1000, cpu_hour_usd=settings.cpu_hour_usd)
    marker = handle.export_marker()
    export_at = f"{client.store.location}results/{job}/export/"
    doc: dict[str, Any] = {**counts, "skipped": int(meta.get("skipped", 0)), "exported": bool(marker),
                           "progress": {k: v for k, v in progress.as_dict().items() if k not in ("job", "counts")},
                           "cost": cost.as_dict(),
                           "export": {"at": export_at, **marker} if marker else None}
    if _as_json(as_json):
        print(json.dumps(doc))
        return
    out = Console(soft_wrap=True)
    out.print(counts_table(f"job {job}", counts, int(meta.get("skipped", 0))))
    for line in meta.get("skipped_sample", [])[:10] if meta.get("skipped") else []:
        out.print(f"  skipped {escape(line)}", highlight=False)
    if not progress.complete:
        out.print(f"progress {progress.finished:,}/{progress.total:,} · {progress.img_per_s:.1f} img/s · "
                  f"ETA {duration(progress.eta_s)} · running for {duration(progress.elapsed_s)}", highlight=False)
    price = "OCRQ_CPU_HOUR_USD" if cost.device == "cpu" else "OCRQ_GPU_HOUR_USD"
    unit = cost.unit.removesuffix("-s")
    ran = f" ({', '.join(cost.engines)} on {cost.device.upper() if cost.device in ('cpu', 'gpu') else 'CPU and GPU'})" \
        if cost.engines else ""
    out.print(f"engine {cost.engine_seconds:.2f} {cost.unit}{ran} over {cost.batches} batches for "
              f"{images(cost.engine_images)} (the rest cached or failed) · {cost.img_per_s:.2f} img/s · "
              f"${cost.usd_per_1000_images:.4f} per 1,000 images at ${cost.hour_usd:.2f}/{unit}-h ({price})",
              highlight=False)
    out.print(f"store {cost.store_puts_per_image:.2f} PUT + {cost.store_gets_per_image:.2f} GET per image · "
              f"${cost.store_usd_per_1000_images:.4f} per 1,000 images at ${settings.store.put_usd_per_1000}"
              f" / ${settings.store.get_usd_per_1000} per 1,000 PUT / GET (OCRQ_STORE__PUT_USD_PER_1000, "
              "OCRQ_STORE__GET_USD_PER_1000)", highlight=False)
    if marker:
        out.print(f"export: {marker.get('lines')} lines, {', '.join(marker.get('files', []))} under "
                  f"{escape(export_at)}", highlight=False)


def export(job: str, wait: bool = typer.Option(False, "--wait", help="wait for the job, then for its _SUCCESS"),
           timeout: float | None = typer.Option(None, help="seconds to wait at most"),
           fmt: str = typer.Option("jsonl", "--format", help="jsonl (+ Parquet if asked) | openai-batch"),
           out: Path | None = typer.Option(None, "--out", "-o", help="openai-batch: a local directory"),
           as_json: bool = typer.Option(False, "--json", help="the _SUCCESS marker as JSON on stdout (the default "
                                        "when stdout is not a terminal)")) -> None:
    """(Re)write JOB's export (results JSONL, Parquet if asked, then _SUCCESS) through a worker,
    and say where it is; --wait follows an unfinished job first (exit codes: `ocrq --help`).
    --format openai-batch: its OpenAI Batch output and error files, here (partial while it runs)."""
    if fmt != "jsonl" or out is not None:  # (ocrq_cli.openai_batch)
        from ocrq_cli import openai_batch as batch

        return batch.export(job, fmt, out, wait, timeout, _as_json(as_json))
    from producer.errors import NotFinished, WaitTimedOut

    client = make_client(command_settings())
    handle = job_handle(client, job)
    t0 = time.monotonic()
    if not handle.finished():
        if not wait:
            c = handle.status()
            raise NotFinished(f"job {job} is not finished ({c['done'] + c['failed']:,} of {c['total']:,} images "
                              f"final): its export is written when it finishes; `ocrq export {job} --wait` waits")
        follow(client, job, timeout)
    if not client.request_export(job, force=True):
        raise NotFinished(f"job {job} is not finished: {handle.status()}")
    if not wait:
        console.print(f"job {escape(job)}: export asked for; a worker writes it under "
                      f"{escape(client.store.location)}results/{escape(job)}/export/ (`ocrq export {job} --wait` "
                      "waits for its _SUCCESS)")
        return
    left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
    try:
        with console.status(f"job {job}: writing its export"):
            marker = handle.wait_export(timeout=left)
    except TimeoutError as exc:
        raise WaitTimedOut(f"timed out after {timeout:g}s: job {job} has no {'_SUCCESS'} yet; a worker writes its "
                           "export (`ocrq status` shows it once written)") from exc
    where = f"{client.store.location}results/{job}/export/"
    files = ", ".join(f"{where}{name}" for name in marker.get("files", []))
    console.print(f"job {escape(job)}: exported {marker.get('lines', 0):,} lines: {escape(files)}, then "
                  f"{escape(where)}_SUCCESS")
    if _as_json(as_json):
        print(json.dumps({**marker, "at": where}))
    counts = marker.get("counts") or handle.status()
    outcome(client, job, counts)


def results(job: str, out: Path | None = typer.Option(None, "--out", "-o")) -> None:
    """Every image of JOB as JSON lines (stdout or --out; exit 1 if there is no such job)."""
    handle = job_handle(make_client(command_settings()), job)
    if out is not None:
        console.print(f"wrote {write_results(handle, out)} lines to {out}")
        return
    for result in handle.results():
        sys.stdout.write(json.dumps(result.to_line(), ensure_ascii=False) + "\n")


def jobs() -> None:
    """Known jobs with their counts (one JSON line each)."""
    client = make_client(command_settings())
    names = client.index.jobs()
    for name in names:
        print(json.dumps({"job": name, **client.index.counts(name)}))
    if not names:
        console.print("no jobs yet: `ocrq submit DIR --job NAME` makes one")


def reprocess(job: str | None = typer.Option(None, "--job", "-j"),
              error: str | None = typer.Option(None, "--error", "-e", help="only failures of this error type"),
              dry_run: bool = typer.Option(False, "--dry-run", help="list what would be re-published"),
              wait: bool = typer.Option(False, "--wait", help="wait for them; exit 3 if any fails again"),
              timeout: float | None = typer.Option(None, help="seconds to wait at most")) -> None:
    """Re-run failed images (all jobs, or one) with a fresh attempt budget, on each job's own
    queue and priority (exit codes: `ocrq --help`)."""
    from ocrq.jobs.failed import registered
    from producer.errors import ImagesFailed

    client = make_client(command_settings())
    if job is not None:
        job_handle(client, job)
    listed = list(registered(client.index, client.store, job, error))
    # a named job's cancelled images run again too (without --error)
    unrun = client.index.counts(job).get("cancelled", 0) if job is not None and error is None else 0
    if dry_run:  # what reprocess_failed would read, listed: one pass over the registry
        for entry in listed:
            rec = entry.record
            print(f"{rec.job}\t{rec.id}\t{rec.ref}\t{entry.why(200)}")
        also = f" and {images(unrun)} its cancel stopped" if unrun else ""
        console.print(f"would re-publish {images(len(listed))} that failed{also} (dry run: nothing published)")
        return
    n = client.reprocess_failed(job, error=error)
    also = f" ({images(unrun)} of them cancelled before)" if unrun else ""
    console.print(f"re-published {images(n)} that failed{also}")
    if not (wait and n):
        return
    by_job: dict[str, set[str]] = {job: set()} if unrun and job is not None else {}
    for entry in listed:
        by_job.setdefault(entry.record.job, set()).add(entry.record.id)
    t0 = time.monotonic()
    failed_again = 0
    for name, ids in by_job.items():
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        counts = follow(client, name, left).counts
        print_counts(name, counts)
        again = {e.record.id for e in registered(client.index, client.store, name)} & ids
        if again:
            print_failed(client, name, len(again), ids=again)
            failed_again += len(again)
    if failed_again:
        raise ImagesFailed(job or f"{len(by_job)} jobs", failed_again, n, "reprocessed images")


def cancel(job: str, wait: bool = typer.Option(False, "--wait", help="wait until the job's export is written"),
           timeout: float | None = typer.Option(None, help="seconds to wait (exit 4 past it; the job goes on)")
           ) -> None:
    """Cancel JOB: images not yet started never run, running ones finish and are kept; the job
    ends cancelled with an export of what finished (`ocrq reprocess --job JOB` runs the rest)."""
    from producer.errors import WaitTimedOut

    client = make_client(command_settings())
    handle = job_handle(client, job)
    counts = client.cancel(job)
    if not handle.cancelled():
        console.print(f"job {escape(job)} had finished: nothing to cancel")
        print_counts(job, counts)
        return
    console.print(f"job {escape(job)} cancelled: {images(counts['cancelled'])} will not run, "
                  f"{images(counts['running'] + counts['retrying'])} running finish")
    if wait:
        try:
            marker = handle.wait_export(timeout=timeout)
        except TimeoutError as exc:
            raise WaitTimedOut(f"job {job}: its export is not written yet (the images running finish)") from exc
        counts = marker["counts"]
        console.print(f"export written: {marker['lines']} lines under {escape(client.store.location)}"
                      f"results/{escape(job)}/export/")
    print_counts(job, counts)
