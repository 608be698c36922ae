"""``ocrq submit``: image references (or an OpenAI Batch file, ``ocrq_cli.openai_batch``) into a
job, with the intake summary first, optionally waiting for every image."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ocrq.errors import OcrqError
from ocrq.messages import TASKS, check_task
from ocrq_cli.common import (
    command_settings,
    console,
    make_client,
    outcome,
    print_counts,
    print_submitted,
    write_results,
)
from ocrq_cli.progress import follow
from producer.errors import InputUnreadable, SubmissionRefused
from producer.name_filter import NameFilter


def _parse_params(pairs: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise typer.BadParameter(f"{pair!r}: expected key=value", param_hint="--param")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def submit(
    refs: list[str] = typer.Argument(None, help="paths, dirs, s3://bucket/key or prefix/, URLs, .jsonl/.csv manifests"),
    job: str = typer.Option(..., "--job", "-j"),
    task: str = typer.Option("text", help=" | ".join(TASKS) + " (rapidocr: text, spotting)"),
    param: list[str] = typer.Option([], "--param", "-p", help="task parameter key=value (JSON values)"),
    priority: int | None = typer.Option(None, min=0, max=9),
    wait: bool = typer.Option(False, "--wait", help="wait for every image to finish"),
    out: Path | None = typer.Option(None, "--out", "-o", help="write one JSON line per image (implies --wait)"),
    timeout: float | None = typer.Option(None, help="seconds to wait at most"),
    show: bool = typer.Option(False, "--print", help="print each image's text when done (implies --wait)"),
    parquet: bool = typer.Option(False, "--parquet", help="the job's export at completion includes Parquet"),
    republish: bool = typer.Option(False, "--republish", help="the same submission again: also send what no "
                                   "worker finished (the recovery after Redis lost data)"),
    openai_batch: str | None = typer.Option(None, "--openai-batch", help="an OpenAI Batch input file (path, "
                                            "s3:// key or URL), one image per line; --out is then a directory"),
    match: list[str] = typer.Option([], "--match", "-m", help="of the files found in folders and s3:// prefixes, "
                                    "take those whose name matches (shell pattern, any case; repeat for more: "
                                    "-m '*.png' -m '*.jpg'); the rest are skipped"),
) -> None:
    """Submit image references as job JOB (exit codes: `ocrq --help`)."""
    names = _name_filter(match, openai_batch)
    if openai_batch is not None or not refs:  # (ocrq_cli.openai_batch)
        from ocrq_cli import openai_batch as batch

        return batch.submit(refs, openai_batch, job, priority, wait or show, out, timeout)
    params = _parse_params(param)
    try:
        check_task(task)  # before any file is listed
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--task") from exc
    settings = command_settings()
    client = make_client(settings)
    client.check_supported(task, params, settings.queue.name)  # before any file is listed
    t0 = time.monotonic()
    try:
        plan = client.plan(refs, match=names)
    except (OcrqError, ValueError) as exc:  # a container we cannot read: refused, nothing published
        raise InputUnreadable(f"{type(exc).__name__}: {exc}") from exc
    _print_plan(job, plan)
    if plan.refused:
        plan.close()
        raise SubmissionRefused(plan)
    if not plan.accepted:
        console.print(f"[yellow]no images in {escape(' '.join(refs))}[/]: job {escape(job)} has nothing to run")
    with _submit_progress(plan.accepted) as progress:
        handle = client.submit(plan, job=job, task=task, params=params, priority=priority,
                               parquet=parquet, republish=republish, progress=progress)
    print_submitted(job, handle, time.monotonic() - t0, republish)
    if not (wait or out or show):
        return
    # (nothing new and all final: no progress to follow, and no rate to make up)
    counts = handle.status() if not handle.published and handle.finished() else follow(client, job, timeout).counts
    elapsed = time.monotonic() - t0
    if out is not None:
        n = write_results(handle, out)
        console.print(f"wrote {n} lines to {out}")
    if show:
        _show(handle)
    print_counts(job, counts, elapsed, published=handle.published)
    outcome(client, job, counts)


@contextmanager
def _submit_progress(total: int) -> Iterator[Callable[[str, int, int], None] | None]:
    """A progress bar for a large submission (recording, then writing its refs to the store)."""
    if total < 50_000:
        yield None
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def show(phase: str, done: int, of: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=of)
            bar.update(tasks[phase], completed=done)

        yield show


def _name_filter(match: list[str], openai_batch: str | None) -> NameFilter:
    """``--match`` as a filter, or the usage error (exit 2) that says why not."""
    if match and openai_batch is not None:
        raise typer.BadParameter("an OpenAI Batch file names each image: there is no folder to filter",
                                 param_hint="--match")
    try:
        return NameFilter.of(match)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--match") from exc


def _print_plan(job: str, plan: Any, shown: int = 20) -> None:
    """The intake summary, before anything is published: every file is accounted for."""
    console.print(f"job [bold]{escape(job)}[/]: {plan.summary()}")
    for title, entries, total in (("skipped", plan.skipped_sample, plan.skipped),
                                  ("merged", plan.merged_sample, plan.duplicates),
                                  ("refused", plan.refused_sample, plan.refused)):
        for entry in entries[:shown]:
            colour = "red" if title == "refused" else "yellow"
            console.print(f"  [{colour}]{title}[/] {escape(entry.value)}: {escape(entry.reason)}")
        if total > shown:
            console.print(f"  … and {total - shown} more {title}")
    hint = plan.hint()
    if hint:
        console.print(f"  [bold]hint[/]: {escape(hint)}")


def _show(handle: Any) -> None:
    for result in sorted(handle.results(), key=lambda r: r.record.ref):
        rec = result.record
        head = escape(f"{Path(rec.ref).name}  [{rec.status.value}{' · cached' if rec.cached else ''}]")
        console.print(f"[bold cyan]{head}[/]")
        if rec.error:
            console.print(f"  [red]{rec.error.type}[/]: {escape(rec.error.message)}")
        for line in result.text.splitlines():
            console.print(f"  {line}", markup=False, highlight=False)
