"""Step 1: every image of the chunk fetched and hashed, in the fetch pool, a few groups per chunk
(worker.chunk.fanout), overlapping other chunks' inference.

A plain image file is one cache unit keyed by the sha256 of its bytes: it is fetched and hashed
here and decoded only on a cache miss (worker.chunk.decode). A PDF's pages are cached one by one,
keyed by their rendered pixels, and those keys exist only after rendering: a PDF is rendered here,
through ``ctx.decoder`` (supervised child processes with ``limits.decode_isolation``,
worker.decoding.decode), and its pages are the units checked.

The images the message refused (``ocrq.messages.read_chunk``) are never fetched, nor those of a
task or prompt this engine cannot honour (``UnsupportedTask``): their error stands. Typed errors
from refs and documents stay as they are, anything else is classified.
"""

from __future__ import annotations

import os
from dataclasses import replace

from ocrq import keys
from ocrq.capabilities import unsupported
from ocrq.errors import OcrqError, UnsupportedTask, classify
from ocrq.messages import Chunk, Item
from ocrq.net.fetch import fetch as fetch_ref
from ocrq.refs import is_local
from worker.chunk.attempt import Attempt, Fetched, Unit, frozen
from worker.chunk.fanout import fan_out
from worker.chunk.needs import Worker
from worker.decoding.documents import is_pdf
from worker.decoding.images import decode, sha256_hex
from worker.decoding.page import Page


def fetch(ctx: Worker, attempt: Attempt) -> Attempt:
    """The attempt with its images fetched (``images``) or failed (``errors``)."""
    chunk = attempt.chunk
    errors: dict[str, OcrqError] = {}
    caps = ctx.capabilities()
    todo = []
    for it in chunk.items:
        if it.id in attempt.errors:
            continue
        why = unsupported(caps, *chunk.spec(it))
        if why is None:
            todo.append(it)
        else:
            errors[it.id] = UnsupportedTask(f"{why}: it runs {', '.join(caps['tasks'])}"
                                            + ("" if caps["custom_prompt"] else ", without custom prompts"))
    outcomes = fan_out(ctx.fetch_pool, fetch_groups(ctx, chunk), lambda it: fetch_one(ctx, chunk, it), todo)
    images: dict[str, Fetched] = {}
    for it, outcome in zip(todo, outcomes, strict=True):
        if isinstance(outcome, Exception):
            errors[it.id] = classify(outcome)
        else:
            images[it.id] = outcome
    return replace(attempt, images=frozen(images), errors=attempt.failed(errors))


def fetch_groups(ctx: Worker, chunk: Chunk) -> int:
    """Fetch-pool groups for a chunk: ``limits.fetch_threads`` when any ref is remote (S3, HTTP:
    the threads wait on the network), at most one per CPU when all are local files. Reading a
    local file is CPU work in Python between short syscalls, each a GIL hand-off: eight threads
    doing it on two cores cost 15-20% more CPU per image than two (docs/bench/overhead.md)."""
    threads = ctx.settings.limits.fetch_threads
    if all(is_local(it.ref) for it in chunk.items):
        return max(1, min(threads, os.cpu_count() or 1))
    return threads


def fetch_one(ctx: Worker, chunk: Chunk, item: Item) -> Fetched:
    """Fetch and hash one image (and render a PDF); a plain image's decode waits for the cache."""
    data = fetch_ref(item.ref, ctx.settings.limits, s3_client=ctx.s3_client, store=ctx.store, job=chunk.job)
    sha = sha256_hex(data)

    def key(content: str) -> str:
        return keys.cache_key(content, ctx.engine.revision, *chunk.spec(item))

    if is_pdf(data):  # PDF pages: cached page by page, by their pixels
        pages = decode_bytes(ctx, data)
        return Fetched(item, sha, tuple(Unit(key(pg.digest or sha), (pg,)) for pg in pages), document=True)
    return Fetched(item, sha, (Unit(key(sha)),), data)


def decode_bytes(ctx: Worker, data: bytes) -> list[Page]:
    """Pages of ``data``, through the isolated decoder when there is one."""
    return ctx.decoder.decode(data) if ctx.decoder else decode(data, ctx.settings.limits)
