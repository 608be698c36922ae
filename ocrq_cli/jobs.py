"""The commands that follow jobs: ``status`` (counts and cost), ``export``, ``results``, ``jobs``
and ``reprocess`` (failed images again)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.markup import escape

from ocrq_cli.common import (
    command_settings,
    console,
    images,
    job_handle,
    make_client,
    print_counts,
    wait_progress,
    write_results,
)


def status(job: str) -> None:
    """Counts per status for JOB, and what it cost: GPU-seconds, img/s, $ per 1,000 images
    (exit 1 if there is no such job)."""
    from ocrq.jobcost import job_cost

    settings = command_settings()
    client = make_client(settings)
    handle = job_handle(client, job)
    counts = handle.status()
    print_counts(job, counts)
    meta = client.index.meta(job)
    if meta.get("skipped"):
        console.print(f"{meta['skipped']} files skipped at submit, e.g.:")
        for line in meta.get("skipped_sample", [])[:10]:
            console.print(f"  {escape(line)}")
    cost = job_cost(client.index, job, settings.gpu_hour_usd, settings.store.put_usd_per_1000,
                    settings.store.get_usd_per_1000)
    console.print(f"engine {cost.gpu_seconds:.2f} GPU-s over {cost.batches} batches for {cost.engine_images} "
                  f"images (the rest cached or failed) · {cost.img_per_s:.2f} img/s · "
                  f"${cost.usd_per_1000_images:.4f} per 1,000 images at ${cost.gpu_hour_usd:.2f}/GPU-h "
                  "(OCRQ_GPU_HOUR_USD)")
    console.print(f"store {cost.store_puts_per_image:.2f} PUT + {cost.store_gets_per_image:.2f} GET per image · "
                  f"${cost.store_usd_per_1000_images:.4f} per 1,000 images at ${settings.store.put_usd_per_1000}"
                  f" / ${settings.store.get_usd_per_1000} per 1,000 PUT / GET (OCRQ_STORE__PUT_USD_PER_1000, "
                  "OCRQ_STORE__GET_USD_PER_1000)")
    marker = handle.export_marker()
    if marker:
        console.print(f"export: {marker.get('lines')} lines, {', '.join(marker.get('files', []))} "
                      f"under {escape(client.store.location)}results/{escape(job)}/export/")
    print(json.dumps({**counts, "skipped": int(meta.get("skipped", 0)), "exported": bool(marker),
                      "cost": cost.as_dict()}))


def export(job: str, wait: bool = typer.Option(False, "--wait", help="wait for the _SUCCESS marker"),
           timeout: float | None = typer.Option(None),
           fmt: str = typer.Option("jsonl", "--format", help="jsonl (+ Parquet if asked) | openai-batch"),
           out: Path | None = typer.Option(None, "--out", "-o", help="openai-batch: a local directory")) -> None:
    """(Re)write JOB's export (results JSONL, Parquet if asked, then _SUCCESS) through a worker;
    --format openai-batch: its OpenAI Batch output and error files, here (partial while it runs)."""
    if fmt != "jsonl" or out is not None:  # (ocrq_cli.openai_batch)
        from ocrq_cli import openai_batch as batch

        return batch.export(job, fmt, out, wait, timeout)
    client = make_client(command_settings())
    handle = job_handle(client, job)
    if not client.request_export(job, force=True):
        console.print(f"job {escape(job)} is not finished: {handle.status()}")
        raise typer.Exit(code=1)
    if wait:
        print(json.dumps(handle.wait_export(timeout=timeout)))


def results(job: str, out: Path | None = typer.Option(None, "--out", "-o")) -> None:
    """Every image of JOB as JSON lines (stdout or --out; exit 1 if there is no such job)."""
    handle = job_handle(make_client(command_settings()), job)
    if out is not None:
        console.print(f"wrote {write_results(handle, out)} lines to {out}")
        return
    for result in handle.results():
        sys.stdout.write(json.dumps(result.to_line(), ensure_ascii=False) + "\n")


def jobs() -> None:
    """Known jobs with their counts."""
    client = make_client(command_settings())
    for name in client.index.jobs():
        print(json.dumps({"job": name, **client.index.counts(name)}))


def reprocess(job: str | None = typer.Option(None, "--job", "-j"),
              error: str | None = typer.Option(None, "--error", "-e", help="only failures of this error type"),
              dry_run: bool = typer.Option(False, "--dry-run", help="list what would be re-published"),
              wait: bool = typer.Option(False, "--wait")) -> None:
    """Re-run failed images (all jobs, or one) with a fresh attempt budget, on each job's own
    queue and priority."""
    client = make_client(command_settings())
    if dry_run:  # what reprocess_failed would read, listed: one pass over the registry
        from ocrq.failed import registered

        listed = list(registered(client.index, client.store, job, error))
        for entry in listed:
            rec = entry.record
            print(f"{rec.job}\t{rec.id}\t{rec.ref}\t{entry.why(200)}")
        console.print(f"would re-publish {images(len(listed))} that failed (dry run: nothing published)")
        return
    n = client.reprocess_failed(job, error=error)
    console.print(f"re-published {n} failed images")
    if wait and job:
        print_counts(job, wait_progress(client.job(job), None))


def cancel(job: str, wait: bool = typer.Option(False, "--wait", help="wait until the job's export is written"),
           timeout: float | None = typer.Option(None, help="seconds to wait (exit 4 past it; the job goes on)")
           ) -> None:
    """Cancel JOB: images not yet started never run, running ones finish and are kept; the job
    ends cancelled with an export of what finished (`ocrq reprocess --job JOB` runs the rest)."""
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
            console.print(f"[yellow]{escape(str(exc))}[/]")
            raise typer.Exit(code=4) from exc
        counts = marker["counts"]
        console.print(f"export written: {marker['lines']} lines under {escape(client.store.location)}"
                      f"results/{escape(job)}/export/")
    print_counts(job, counts)
