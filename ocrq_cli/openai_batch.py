"""``ocrq submit --openai-batch FILE`` and ``ocrq export JOB --format openai-batch``: the command
line of ``producer.openai_batch`` (imported by ``ocrq_cli.submit`` and ``ocrq_cli.jobs`` when those
options are given)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from ocrq.errors import OcrqError
from ocrq_cli.common import (
    command_settings,
    console,
    images,
    job_handle,
    make_client,
    print_counts,
    print_submitted,
    wait_progress,
)


def submit(refs: list[str] | None, source: str | None, job: str, priority: int | None, wait: bool,
           out: Path | None, timeout: float | None) -> None:
    """Submit the lines of an OpenAI Batch file as job ``job``; with ``out``, follow the job and
    write ``out/output.jsonl``, ``out/errors.jsonl`` and (once every line is final) ``out/_SUCCESS``.

    Exit codes: 0 submitted (waiting: every line done), 2 the file cannot be read (nothing
    published), 3 (waiting) some lines failed or could not run, 4 (waiting) timed out, 5 not
    confirmed on the replicas (run it again)."""
    from producer.acked import NotReplicated
    from producer.client import BrokerFull
    from producer.openai_batch import plan_batch, submit_batch, write_files

    if source is None or refs:
        raise typer.BadParameter("give refs, or --openai-batch FILE alone", param_hint="REFS")
    client = make_client(command_settings())
    t0 = time.monotonic()
    try:
        batch = plan_batch(client, source, job=job)
    except (OcrqError, OSError, ValueError) as exc:
        console.print(f"[red]{type(exc).__name__}[/]: {escape(str(exc))}")
        raise typer.Exit(code=2) from exc
    console.print(f"job [bold]{escape(job)}[/]: {escape(source)}: {batch.summary()}")
    for line in batch.rejected[:20]:
        err = line["error"]
        console.print(f"  [red]rejected[/] line {err['line']} ({escape(line['custom_id'] or '-')}): "
                      f"{err['code']}: {escape(err['message'])}")
    if len(batch.rejected) > 20:
        console.print(f"  … and {len(batch.rejected) - 20} more rejected (all in the error file)")
    try:
        handle = submit_batch(client, batch, job=job, priority=priority)
    except BrokerFull as exc:
        console.print(f"[red]submission refused[/]: {escape(str(exc))}")
        raise typer.Exit(code=2) from exc
    except NotReplicated as exc:  # written, but not confirmed on the replicas: run it again
        console.print(f"[red]submission not confirmed[/]: {escape(str(exc))}")
        raise typer.Exit(code=5) from exc
    except (OcrqError, ValueError) as exc:
        console.print(f"[red]{type(exc).__name__}[/]: {escape(str(exc))}")
        raise typer.Exit(code=2) from exc
    print_submitted(job, handle, time.monotonic() - t0, False)
    if not (wait or out):
        return
    try:
        if out is not None:
            marker = write_files(client, job, out, follow=True, timeout=timeout)
            counts = marker["counts"]
            console.print(f"wrote {marker['lines']} lines to {out / 'output.jsonl'} and {marker['error_lines']} "
                          f"to {out / 'errors.jsonl'}, then {out / '_SUCCESS'}")
        else:
            counts = wait_progress(handle, timeout)
    except TimeoutError as exc:
        console.print(f"[yellow]timed out[/] after {timeout:g}s; the job goes on: `ocrq export {job} --format "
                      f"openai-batch --out DIR` writes what is final")
        raise typer.Exit(code=4) from exc
    print_counts(job, counts, time.monotonic() - t0, published=handle.published)
    if counts["failed"] or batch.rejected:
        console.print(f"  {images(counts['failed'])} failed, {len(batch.rejected)} lines rejected: "
                      "each has its line in the error file")
        raise typer.Exit(code=3)


def export(job: str, fmt: str, out: Path | None, wait: bool, timeout: float | None) -> None:
    """Write JOB's OpenAI Batch files: to ``out`` (a directory), else to the store's
    ``results/{job}/export/openai-batch/``; what is final now (``wait``: follow the job to its
    end), ``_SUCCESS`` last once every line is final."""
    from ocrq.openai_responses import export_to_store
    from producer.openai_batch import write_files

    if fmt != "openai-batch":
        raise typer.BadParameter("jsonl (Parquet if asked) | openai-batch (--out DIR with openai-batch only)",
                                 param_hint="--format")
    client = make_client(command_settings())
    handle = job_handle(client, job)
    try:
        if out is not None:
            marker: dict[str, Any] = write_files(client, job, out, follow=wait, timeout=timeout)
        else:
            if wait:
                handle.wait(timeout=timeout)
            marker = export_to_store(client.index, client.store, job)
    except TimeoutError as exc:
        console.print(f"[yellow]timed out[/] after {timeout:g}s: job {escape(job)} is not finished")
        raise typer.Exit(code=4) from exc
    where = out if out is not None else f"{client.store.location}results/{job}/export/openai-batch/"
    state = "complete" if marker["complete"] else "partial: the job is not finished (no _SUCCESS yet)"
    console.print(f"job {escape(job)}: {marker['lines']} output lines, {marker['error_lines']} error lines "
                  f"under {escape(str(where))} ({state})")
    print(json.dumps(marker))
