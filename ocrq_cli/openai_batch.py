"""``ocrq submit --openai-batch FILE`` and ``ocrq export JOB --format openai-batch``: the command
line of ``producer.openai_batch`` (imported by ``ocrq_cli.submit`` and ``ocrq_cli.jobs`` when those
options are given)."""

from __future__ import annotations

import json
import threading
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
    print_failed,
    print_submitted,
)
from ocrq_cli.progress import follow


def submit(refs: list[str] | None, source: str | None, job: str, priority: int | None, wait: bool,
           out: Path | None, timeout: float | None) -> None:
    """Submit the lines of an OpenAI Batch file as job ``job``; with ``out``, follow the job and
    write ``out/output.jsonl``, ``out/errors.jsonl`` and (once every line is final) ``out/_SUCCESS``.
    Exit codes as every waiting command's (``ocrq --help``); a line rejected at submit counts as
    failed."""
    from producer.errors import ImagesFailed, InputUnreadable
    from producer.openai_batch import plan_batch, submit_batch

    if source is None or refs:
        raise typer.BadParameter("give refs, or --openai-batch FILE alone", param_hint="REFS")
    client = make_client(command_settings())
    t0 = time.monotonic()
    try:
        batch = plan_batch(client, source, job=job)
    except (OcrqError, OSError, ValueError) as exc:
        raise InputUnreadable(f"{source}: {type(exc).__name__}: {exc}") from exc
    console.print(f"job [bold]{escape(job)}[/]: {escape(source)}: {batch.summary()}")
    for line in batch.rejected[:20]:
        err = line["error"]
        console.print(f"  [red]rejected[/] line {err['line']} ({escape(line['custom_id'] or '-')}): "
                      f"{err['code']}: {escape(err['message'])}")
    if len(batch.rejected) > 20:
        console.print(f"  … and {len(batch.rejected) - 20} more rejected (all in the error file)")
    handle = submit_batch(client, batch, job=job, priority=priority)
    print_submitted(job, handle, time.monotonic() - t0, False)
    if not (wait or out):
        return
    if out is None:
        counts = follow(client, job, timeout, what="lines").counts
    else:
        marker = _write(client, job, out, timeout)
        counts = marker["counts"]
        console.print(f"wrote {marker['lines']} lines to {out / 'output.jsonl'} and {marker['error_lines']} "
                      f"to {out / 'errors.jsonl'}, then {out / '_SUCCESS'}")
    print_counts(job, counts, time.monotonic() - t0, published=handle.published)
    if counts["failed"] or batch.rejected:
        console.print(f"  {images(counts['failed'])} failed, {len(batch.rejected)} lines rejected: "
                      "each has its line in the error file")
        if counts["failed"]:
            print_failed(client, job, counts["failed"])
        raise ImagesFailed(job, counts["failed"] + len(batch.rejected), batch.lines, "lines")


def _write(client: Any, job: str, out: Path, timeout: float | None) -> dict[str, Any]:
    """Write the job's files into ``out`` as its lines finish (readable meanwhile) while its
    progress is shown; the marker once every line is final."""
    from producer.errors import WaitTimedOut
    from producer.openai_batch import write_files

    got: dict[str, Any] = {}

    def run() -> None:
        try:
            got["marker"] = write_files(client, job, out, follow=True, timeout=timeout)
        except BaseException as exc:  # handed to the main thread
            got["error"] = exc

    writer = threading.Thread(target=run, name="ocrq-openai-files", daemon=True)
    writer.start()
    try:
        follow(client, job, timeout, what="lines")
    except WaitTimedOut:
        writer.join(5)
        raise
    writer.join()
    error = got.get("error")
    if isinstance(error, TimeoutError):
        raise WaitTimedOut(f"timed out after {timeout:g}s; the job goes on: `ocrq export {job} --format "
                           "openai-batch --out DIR` writes what is final") from error
    if error is not None:
        raise error
    return dict(got["marker"])


def export(job: str, fmt: str, out: Path | None, wait: bool, timeout: float | None, as_json: bool) -> None:
    """Write JOB's OpenAI Batch files: to ``out`` (a directory), else to the store's
    ``results/{job}/export/openai-batch/``; what is final now (``wait``: follow the job to its
    end), ``_SUCCESS`` last once every line is final."""
    from ocrq.output.openai_responses import export_to_store
    from producer.openai_batch import write_files

    if fmt != "openai-batch":
        raise typer.BadParameter("jsonl (Parquet if asked) | openai-batch (--out DIR with openai-batch only)",
                                 param_hint="--format")
    client = make_client(command_settings())
    handle = job_handle(client, job)
    if out is not None:
        marker: dict[str, Any] = _write(client, job, out, timeout) if wait else write_files(client, job, out)
    else:
        if wait:
            follow(client, job, timeout, what="lines")
        marker = export_to_store(client.index, client.store, job)
    where = out if out is not None else f"{client.store.location}results/{job}/export/openai-batch/"
    state = "complete" if marker["complete"] else "partial: the job is not finished (no _SUCCESS yet)"
    console.print(f"job {escape(job)}: {marker['lines']} output lines, {marker['error_lines']} error lines "
                  f"under {escape(str(where))} ({state})")
    if as_json:
        print(json.dumps(marker))
    if wait:
        counts = marker.get("counts") or handle.status()
        if counts.get("failed") or marker.get("error_lines"):
            if counts.get("failed"):
                print_failed(client, job, counts["failed"])
            from producer.errors import ImagesFailed

            raise ImagesFailed(job, max(counts.get("failed", 0), marker.get("error_lines", 0)),
                               marker.get("lines", 0) + marker.get("error_lines", 0), "lines")
