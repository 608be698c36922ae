"""The ``ocrq`` command line. Each command builds the process's settings once and passes them on.

    ocrq up [--allow DIR] [--gpus all|0,1] | down  embedded stack (Redis, a worker or one per GPU, Flower)
    ocrq flower                                 Flower on the ocrq app, behind basic auth
    ocrq submit REF... --job J [--wait --out F] submit images, optionally wait and write JSONL
    ocrq status J | results J [--out F] | jobs  follow jobs
    ocrq export J [--wait] [--format openai-batch --out DIR]  (re)write a job's export + _SUCCESS
    ocrq submit --openai-batch FILE --job J [--wait --out DIR]  an OpenAI Batch file, one image per line
    ocrq failed [--job J --error T --since 2h] | failed show ID | failed purge   the failed registry
    ocrq reprocess [--job J] [--error T] [--dry-run]                           re-run failed images
    ocrq worker [--queues Q,...]                run a worker in the foreground (ocrq[worker])
    ocrq metrics [--port 9808]                  Prometheus exporter (reads Redis)
    ocrq model make-random --size tiny|full --out DIR   random-weight HunyuanOCR checkpoint
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ocrq.errors import OcrqError
from ocrq.messages import TASKS, check_task
from ocrq.settings import Settings, load_settings
from ocrq_cli.failed import failed_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="OCR task-queue fleet.")
model_app = typer.Typer(no_args_is_help=True, help="Model checkpoints.")
app.add_typer(model_app, name="model")
app.add_typer(failed_app, name="failed")
# soft_wrap: a long path or URL stays on one line (copied whole), not broken at 80 columns
console = Console(stderr=True, soft_wrap=True)


@app.callback()
def _main(config: Path | None = typer.Option(None, "--config", "-c", envvar="OCRQ_CONFIG",
                                             help="YAML settings profile (configs/*.yaml)")) -> None:
    if config is not None:
        os.environ["OCRQ_CONFIG"] = str(config)


def _settings() -> Settings:
    s = load_settings()
    logging.basicConfig(level=s.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return s


def _client(settings: Settings) -> Any:
    from producer.client import Client

    return Client(settings)


@app.command()
def up(wait: float = typer.Option(300, help="seconds to wait for the workers to be ready"),
       allow: list[Path] = typer.Option([], "--allow", help="a directory the workers may read local files "
                                        "from (repeatable; default: limits.allowed_roots, else here)"),
       gpus: str | None = typer.Option(None, help="one worker per GPU: all, or NVML indices/UUIDs like 0,1 "
                                                  "(with a GPU profile, e.g. --config configs/gpu-vllm.yaml)"),
       ha: bool = typer.Option(False, "--ha", help="a local HA Redis: 3 redis-server + 3 Sentinels "
                               "(with redis.url naming them: --config configs/ha.yaml)"),
       ) -> None:
    """Start the embedded stack in the background (state under ./var/)."""
    import os
    import socket

    from ocrq.gpus import list_gpus, plan_gpu_workers, select_gpus, sharing_note
    from ocrq.stack import Stack, StackConflict

    settings = _settings()
    workers = None
    if gpus is not None:
        try:
            workers = plan_gpu_workers(settings, select_gpus(gpus, list_gpus()), socket.gethostname())
        except ValueError as exc:
            console.print(f"[red]{escape(str(exc))}[/]")
            raise typer.Exit(code=2) from exc
        note = sharing_note(settings, os.environ)
        if note:
            console.print(f"[yellow]{escape(note)}[/]")
    try:
        status = Stack(settings, allow=allow).up(wait=wait, workers=workers, ha=ha)
    except StackConflict as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(code=2) from exc
    except RuntimeError as exc:  # a service that did not start: its log says why
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(code=1) from exc
    for name, what in status.items():
        console.print(f"[green]{name:7}[/] {what}", highlight=False)


@app.command()
def flower(address: str = typer.Option("0.0.0.0", help="address Flower binds")) -> None:
    """Run Flower in the foreground on the ocrq app, behind basic auth (OCRQ_FLOWER_BASIC_AUTH,
    else a password generated into the var dir), as `ocrq up` and the compose stack do."""
    from ocrq.stack import Stack, flower_argv

    settings = _settings()
    auth, where = Stack(settings).flower_auth()
    console.print(f"flower on port {settings.flower_port}, basic auth from {where}")
    argv, env = flower_argv(settings, auth, address=address)
    os.execve(argv[0], argv, {**os.environ, **env})


@app.command()
def down() -> None:
    """Stop what `ocrq up` started (here: the stack whose state is under ./var/)."""
    from ocrq.stack import Stack

    stack = Stack(_settings())
    stopped = stack.down()
    for name, what in stopped.items():
        console.print(f"{name:7} {what}")
    if all(what == "not running" for what in stopped.values()):
        others = stack.others()
        if others:  # the user is in the wrong directory: say where the running stack is
            console.print(f"[red]nothing was started from {stack.var}; the stack on "
                          f"{stack.settings.redis.url} runs from {', '.join(others)}: run `ocrq down` "
                          f"in {', '.join(str(Path(o).parent) for o in others)}[/]")
            raise typer.Exit(code=1)
        console.print(f"no stack was running from {stack.var}")


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


@app.command()
def submit(
    refs: list[str] = typer.Argument(None, help="paths, dirs, s3://bucket/key or prefix/, URLs, .jsonl/.csv manifests"),
    job: str = typer.Option(..., "--job", "-j"),
    task: str = typer.Option("text", help=" | ".join(TASKS)),
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
) -> None:
    """Submit image references as job JOB.

    Exit codes: 0 submitted (with --wait: every image done), 2 submission refused (nothing
    published), 3 (with --wait) some images failed, 4 (with --wait) timed out, 5 not confirmed
    on the replicas (a Sentinel broker failed over: run it again)."""
    if openai_batch is not None or not refs:  # (ocrq_cli.openai_batch)
        from ocrq_cli import openai_batch as batch

        return batch.submit(refs, openai_batch, job, priority, wait or show, out, timeout)
    params = _parse_params(param)
    try:
        check_task(task)  # before any file is listed
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--task") from exc
    settings = _settings()
    client = _client(settings)
    t0 = time.monotonic()
    try:
        plan = client.plan(refs)
    except (OcrqError, ValueError) as exc:  # a container we cannot read: no traceback
        console.print(f"[red]{type(exc).__name__}[/]: {escape(str(exc))}")
        raise typer.Exit(code=2) from exc
    _print_plan(job, plan)
    if plan.refused:
        plan.close()
        console.print(f"[red]submission refused[/]: nothing published for job {escape(job)}")
        raise typer.Exit(code=2)
    if not plan.accepted:
        console.print(f"[yellow]no images in {escape(' '.join(refs))}[/]: job {escape(job)} has nothing to run")
    from producer.acked import NotReplicated
    from producer.client import BrokerFull

    try:
        with _submit_progress(plan.accepted) as progress:
            handle = client.submit(plan, job=job, task=task, params=params, priority=priority,
                                   parquet=parquet, republish=republish, progress=progress)
    except BrokerFull as exc:  # the broker's Redis is full: new work waits, running jobs go on
        console.print(f"[red]submission refused[/]: {escape(str(exc))}")
        raise typer.Exit(code=2) from exc
    except NotReplicated as exc:  # written, but not confirmed on the replicas: run it again
        console.print(f"[red]submission not confirmed[/]: {escape(str(exc))}")
        raise typer.Exit(code=5) from exc
    except (OcrqError, ValueError) as exc:  # a bad job name: no traceback
        console.print(f"[red]{type(exc).__name__}[/]: {escape(str(exc))}")
        raise typer.Exit(code=2) from exc
    _print_submitted(job, handle, time.monotonic() - t0, republish)
    if not (wait or out or show):
        return
    try:
        counts = _wait(handle, timeout)
    except TimeoutError as exc:
        counts = handle.status()
        final = counts["done"] + counts["failed"]
        console.print(f"[yellow]timed out[/] after {timeout:g}s: {final} of {_images(counts['total'])} final in job "
                      f"{escape(job)} (queued {counts['queued']}, running {counts['running']}, retrying "
                      f"{counts['retrying']}). The job goes on: `ocrq status {job}` follows it, "
                      f"`ocrq export {job} --wait` waits for its export")
        raise typer.Exit(code=4) from exc
    elapsed = time.monotonic() - t0
    if out is not None:
        n = _write_results(handle, out)
        console.print(f"wrote {n} lines to {out}")
    if show:
        _show(handle)
    _print_counts(job, counts, elapsed, published=handle.published)
    if counts["failed"]:
        _print_failed(client, job, counts["failed"])
        raise typer.Exit(code=3)


def _print_submitted(job: str, handle: Any, took: float, republish: bool) -> None:
    """What the submit added to the job, or why it added nothing."""
    counts = handle.status()
    open_ = counts["total"] - counts["done"] - counts["failed"]
    if republish and handle.resumed:
        console.print(f"job [bold]{job}[/]: {_images(handle.published)} sent again in {took:.2f}s")
    elif handle.published:
        console.print(f"job [bold]{job}[/]: {_images(handle.published)} submitted in {took:.2f}s")
    elif not open_:
        console.print(f"job [bold]{job}[/]: 0 images submitted: every accepted image already finished in this job")
    else:
        console.print(f"job [bold]{job}[/]: 0 images submitted: every accepted image is already in this job, "
                      f"{_images(open_)} of it not final yet (the workers go on"
                      + ("; after Redis lost data, `--republish` sends them again)" if handle.resumed else ")"))


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


def _images(n: int) -> str:
    return f"{n} image" + ("" if n == 1 else "s")


def _print_failed(client: Any, job: str, failed: int, shown: int = 10) -> None:
    """Which images failed and why (the first ``shown``), and where the rest are."""
    from ocrq.failed import registered

    for entry in registered(client.index, client.store, job, limit=shown):
        console.print(f"  [red]failed[/] {escape(entry.record.ref)}: {escape(entry.why())}")
    more = f" (first {shown} above)" if failed > shown else ""
    console.print(f"  [bold]hint[/]: `ocrq failed --job {job}` lists the {_images(failed)} that failed{more};"
                  f" `ocrq reprocess --job {job}` runs them again once fixed")


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


def _wait(handle: Any, timeout: float | None) -> dict[str, int]:
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("done {task.fields[done]} · cached {task.fields[cached]} · failed {task.fields[failed]}"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        tid = bar.add_task(handle.name, total=None, done=0, cached=0, failed=0)

        def show(c: dict[str, int]) -> None:
            bar.update(tid, total=c["total"], completed=c["done"] + c["failed"],
                       done=c["done"], cached=c["cached"], failed=c["failed"])

        return dict(handle.wait(timeout=timeout, on_progress=show))


def _write_results(handle: Any, out: Path) -> int:
    from ocrq.results import json_line

    n = 0
    with out.open("wb") as fh:
        for result in handle.results():
            fh.write(json_line(result.to_line()) + b"\n")
            n += 1
    return n


def _show(handle: Any) -> None:
    for result in sorted(handle.results(), key=lambda r: r.record.ref):
        rec = result.record
        head = escape(f"{Path(rec.ref).name}  [{rec.status.value}{' · cached' if rec.cached else ''}]")
        console.print(f"[bold cyan]{head}[/]")
        if rec.error:
            console.print(f"  [red]{rec.error.type}[/]: {escape(rec.error.message)}")
        for line in result.text.splitlines():
            console.print(f"  {line}", markup=False, highlight=False)


def _print_counts(job: str, counts: dict[str, int], elapsed: float | None = None, published: int = 0) -> None:
    table = Table(title=f"job {job}")
    cols = ("total", "done", "cached", "failed", "queued", "running", "retrying")
    for col in cols:
        table.add_column(col, justify="right")
    table.add_row(*(str(counts.get(c, 0)) for c in cols))
    console.print(table)
    if elapsed and published:  # this run's images: a re-submit's earlier ones are not its work
        console.print(f"{_images(published)} in {elapsed:.1f}s = {published / elapsed:.2f} img/s, "
                      f"{counts['cached']} cache hits in the job")


def _job(client: Any, job: str) -> Any:
    from producer.client import UnknownJob

    try:
        return client.job(job)
    except UnknownJob as exc:
        console.print(f"[red]no such job[/]: {escape(job)} (`ocrq jobs` lists the known ones)")
        raise typer.Exit(code=1) from exc


@app.command()
def status(job: str) -> None:
    """Counts per status for JOB, and what it cost: GPU-seconds, img/s, $ per 1,000 images
    (exit 1 if there is no such job)."""
    from ocrq.jobcost import job_cost

    settings = _settings()
    client = _client(settings)
    handle = _job(client, job)
    counts = handle.status()
    _print_counts(job, counts)
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


@app.command()
def export(job: str, wait: bool = typer.Option(False, "--wait", help="wait for the _SUCCESS marker"),
           timeout: float | None = typer.Option(None),
           fmt: str = typer.Option("jsonl", "--format", help="jsonl (+ Parquet if asked) | openai-batch"),
           out: Path | None = typer.Option(None, "--out", "-o", help="openai-batch: a local directory")) -> None:
    """(Re)write JOB's export (results JSONL, Parquet if asked, then _SUCCESS) through a worker;
    --format openai-batch: its OpenAI Batch output and error files, here (partial while it runs)."""
    if fmt != "jsonl" or out is not None:  # (ocrq_cli.openai_batch)
        from ocrq_cli import openai_batch as batch

        return batch.export(job, fmt, out, wait, timeout)
    client = _client(_settings())
    handle = _job(client, job)
    if not client.request_export(job, force=True):
        console.print(f"job {escape(job)} is not finished: {handle.status()}")
        raise typer.Exit(code=1)
    if wait:
        print(json.dumps(handle.wait_export(timeout=timeout)))


@app.command()
def results(job: str, out: Path | None = typer.Option(None, "--out", "-o")) -> None:
    """Every image of JOB as JSON lines (stdout or --out; exit 1 if there is no such job)."""
    handle = _job(_client(_settings()), job)
    if out is not None:
        console.print(f"wrote {_write_results(handle, out)} lines to {out}")
        return
    for result in handle.results():
        sys.stdout.write(json.dumps(result.to_line(), ensure_ascii=False) + "\n")


@app.command()
def jobs() -> None:
    """Known jobs with their counts."""
    client = _client(_settings())
    for name in client.index.jobs():
        print(json.dumps({"job": name, **client.index.counts(name)}))


@app.command()
def reprocess(job: str | None = typer.Option(None, "--job", "-j"),
              error: str | None = typer.Option(None, "--error", "-e", help="only failures of this error type"),
              dry_run: bool = typer.Option(False, "--dry-run", help="list what would be re-published"),
              wait: bool = typer.Option(False, "--wait")) -> None:
    """Re-run failed images (all jobs, or one) with a fresh attempt budget, on each job's own
    queue and priority."""
    client = _client(_settings())
    if dry_run:  # what reprocess_failed would read, listed: one pass over the registry
        from ocrq.failed import registered

        listed = list(registered(client.index, client.store, job, error))
        for entry in listed:
            rec = entry.record
            print(f"{rec.job}\t{rec.id}\t{rec.ref}\t{entry.why(200)}")
        console.print(f"would re-publish {_images(len(listed))} that failed (dry run: nothing published)")
        return
    n = client.reprocess_failed(job, error=error)
    console.print(f"re-published {n} failed images")
    if wait and job:
        _print_counts(job, _wait(client.job(job), None))


@app.command()
def governor(reset: bool = typer.Option(False, "--reset", help="delete the snapshots: next starts are cold")) -> None:
    """What workers' VRAM governors learned (one JSON line per snapshot in Redis), or --reset."""
    from ocrq import keys, redis_conn

    client = redis_conn.client(_settings().redis)
    found = sorted(client.scan_iter(keys.governor_profile("*")))
    if reset:
        removed = client.delete(*found) if found else 0
        console.print(f"deleted {removed} governor snapshots")
        return
    for key in found:
        raw = client.get(key)
        if raw is None:  # expired since the scan
            continue
        snap = json.loads(raw)
        cal = snap.get("calibration", {})
        print(json.dumps({"key": key.decode(), "observations": cal.get("observations"),
                          "points": len(cal.get("points", [])), "count_limit": snap.get("limit"),
                          "slow_start": snap.get("slow_start"), "ttl_s": client.ttl(key)}))


@app.command()
def worker(queues: str | None = typer.Option(None, help="comma-separated queues (default: settings.queue.name)"),
           concurrency: int | None = typer.Option(None),
           name: str | None = typer.Option(None, "--name", "-n", help="Celery node name, e.g. gpu0@%h")) -> None:
    """Run one worker in the foreground (one per GPU)."""
    from worker.main import run_worker

    run_worker(_settings(), queues=queues.split(",") if queues else None, concurrency=concurrency,
               hostname=name)


@app.command()
def metrics(port: int = typer.Option(9808), host: str = typer.Option("127.0.0.1"),
            queues: str | None = typer.Option(None, help="comma-separated queues (default: the configured one)"),
            ) -> None:
    """Serve Prometheus metrics (queue depth, unacked, failed, jobs, workers' governor state)."""
    from ocrq import redis_conn
    from ocrq.metrics import serve

    settings = _settings()
    serve(redis_conn.client(settings.redis), queues.split(",") if queues else [settings.queue.name],
          host, port, settings.redis)


@model_app.command("make-random")
def make_random(size: str = typer.Option("tiny", help="tiny | full"),
                out: Path = typer.Option(..., "--out", "-o"), seed: int = 0) -> None:
    """Write a random-weight HunyuanOCR-1.5 checkpoint (tests and benchmarks; no download)."""
    from worker.checkpoint import make_random_checkpoint

    path = make_random_checkpoint(out, size=size, seed=seed)  # type: ignore[arg-type]
    console.print(f"wrote {path}")


def main() -> None:
    import redis

    try:
        app()
    except redis.ConnectionError as exc:
        console.print(f"[red]cannot reach Redis[/]: {escape(str(exc))}\n"
                      "start the embedded stack with `ocrq up`, or point OCRQ_REDIS__URL at your Redis")
        sys.exit(2)


if __name__ == "__main__":
    main()
