"""``ocrq failed``: the failed registry from the command line.

    ocrq failed [--job J] [--error TYPE] [--since 2h] [--json] [--from-store]
    ocrq failed show ID            (image id, or JOB/ID)
    ocrq failed purge [--job J] [--error TYPE]

Default output: one JSON line per failed image (its record with the typed error, plus
``failed_at``); ``--json``: one JSON array. ``--from-store`` reads the durable mirror, for when
Redis was lost; it is also used automatically when Redis cannot be reached.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import redis
import typer
from rich.console import Console

from ocrq import keys
from ocrq.broker import redis_conn
from ocrq.jobs import failed as registry
from ocrq.jobs.index import JobIndex
from ocrq.output.parts import document
from ocrq.settings import Settings, load_settings
from ocrq.store.storage import ResultStore, make_store

failed_app = typer.Typer(help="The failed registry: list, show, purge.")
console = Console(stderr=True)
log = logging.getLogger("ocrq.cli")


def _settings() -> Settings:
    return load_settings()


def _index(settings: Settings) -> JobIndex:
    return JobIndex(redis_conn.client(settings.redis), settings.redis.job_ttl)


def _store(settings: Settings) -> ResultStore:
    return make_store(settings.store)


def _since(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return registry.parse_since(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


@failed_app.callback(invoke_without_command=True)
def failed(ctx: typer.Context,
           job: str | None = typer.Option(None, "--job", "-j"),
           error: str | None = typer.Option(None, "--error", "-e", help="error type, e.g. BadImage"),
           since: str | None = typer.Option(None, help="failed within: 30m, 2h, 7d, or an ISO time"),
           as_json: bool = typer.Option(False, "--json", help="one JSON array instead of JSON lines"),
           from_store: bool = typer.Option(False, "--from-store", help="read the durable mirror, not Redis"),
           ) -> None:
    """Failed images with their typed errors (one JSON line each)."""
    if ctx.invoked_subcommand is not None:
        return
    settings = _settings()
    found: Iterator[registry.FailedImage]
    if from_store:
        found = registry.from_store(_store(settings), job, error, _since(since))
    else:
        try:
            redis_conn.probe(settings.redis)  # within 3 s, not after the clients' 30 s of reconnecting
            found = iter(list(registry.registered(_index(settings), _store(settings), job, error,
                                                  _since(since))))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            console.print(f"[yellow]Redis unreachable ({exc}); reading the store's mirror[/]")
            found = registry.from_store(_store(settings), job, error, _since(since))
    lines = (f.line() for f in found)
    if as_json:
        print(json.dumps(list(lines), ensure_ascii=False, indent=1))
        return
    for line in lines:
        print(json.dumps(line, ensure_ascii=False))


@failed_app.command()
def show(image: str = typer.Argument(..., help="image id, or JOB/ID")) -> None:
    """One failed image in full: its record, typed error, attempts and stored result."""
    settings = _settings()
    index = _index(settings)
    store = _store(settings)
    where = registry.find(index, image, store)
    if where is None:
        console.print(f"[red]{image}[/]: not in the failed registry (try JOB/ID)")
        raise typer.Exit(code=1)
    job, image_id = where
    out: dict[str, Any] = {}
    rec = index.get(job, [image_id])[0]
    score = index.redis.zscore(keys.job_failed(job), image_id)
    mirror = store.get_json(keys.failed_object(job, image_id))
    if rec is None and isinstance(mirror, dict):  # an archived job's: its record is in the mirror
        rec_doc = mirror.get("record")
        out["record"] = rec_doc
        score = mirror.get("failed_at") if score is None else score
    elif rec is not None:
        out["record"] = rec.model_dump(mode="json", exclude_none=True)
    out["failed_at"] = score
    out["in_registry"] = score is not None
    stored = document(index, store, job, image_id, mirror.get("document") if isinstance(mirror, dict) else None)
    doc = None if stored is None else stored.model_dump(mode="json")
    if doc is not None:
        out["result"] = doc
    if not out.get("record") and doc is None:
        console.print(f"[red]{image}[/]: no record in Redis nor result in the store")
        raise typer.Exit(code=1)
    print(json.dumps(out, ensure_ascii=False, indent=1))


@failed_app.command()
def purge(job: str | None = typer.Option(None, "--job", "-j"),
          error: str | None = typer.Option(None, "--error", "-e"),
          all_jobs: bool = typer.Option(False, "--all", help="required to purge every job's failures")) -> None:
    """Forget failed images (registry + durable mirror); their job records stay failed."""
    if job is None and error is None and not all_jobs:
        console.print("[red]refusing to purge every failure[/]: give --job, --error or --all")
        raise typer.Exit(code=2)
    settings = _settings()
    n = registry.purge(_index(settings), _store(settings), job, error)
    console.print(f"purged {n} failed images")
