"""A chunk's images before the engine: fetch + hash, cache units, decode of the misses only.

A plain image file is one cache unit keyed by the sha256 of its bytes, so it is fetched and
hashed, checked against the cache, and decoded only on a miss (a hit never decodes). A PDF's
pages are cached one by one, keyed by their rendered pixels (worker.decoding.documents): the same page in
another file or another rendering of the same document is a hit. Those keys exist only after
rendering, so a PDF is rendered when it is fetched, and its pages are the units checked.

All decoding (plain images on a miss, PDFs at once) goes through ``ctx.decoder``: in supervised
child processes with ``limits.decode_isolation`` (worker.decoding.decode), so a decoder that crashes or
hangs fails one image with ``DecoderCrashed`` instead of the worker.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ocrq import keys
from ocrq.messages import Chunk, Item
from ocrq.net.fetch import fetch
from ocrq.refs import is_local
from ocrq.results import OcrOutput
from worker.context import WorkerContext
from worker.decoding.documents import is_pdf
from worker.decoding.images import decode, sha256_hex
from worker.decoding.page import Page
from worker.fanout import fan_out


@dataclass
class Unit:
    """What one cache entry covers: a whole image file (all its frames), or one PDF page."""

    cache_key: str
    #: decoded pages (empty for a plain image until its cache miss is decoded)
    pages: list[Page]


@dataclass
class Prepared:
    item: Item
    sha256: str
    units: list[Unit]
    #: a plain image's fetched bytes until they are decoded (only cache misses are; then released)
    data: bytes = b""
    #: a PDF: rendered at fetch time, one unit per page keyed by its pixels
    document: bool = False

    @property
    def cache_key(self) -> str | None:
        """The file's cache key (None for a PDF: each page has its own, in its output's meta)."""
        return None if self.document else self.units[0].cache_key


def decode_bytes(ctx: WorkerContext, data: bytes) -> list[Page]:
    return ctx.decoder.decode(data) if ctx.decoder else decode(data, ctx.settings.limits)


def fetch_groups(ctx: WorkerContext, chunk: Chunk) -> int:
    """Fetch-pool groups for a chunk: ``limits.fetch_threads`` when any ref is remote (S3, HTTP:
    the threads wait on the network), at most one per CPU when all are local files. Reading a
    local file is CPU work in Python between short syscalls, each a GIL hand-off: eight threads
    doing it on two cores cost 15-20% more CPU per image than two (docs/bench/overhead.md)."""
    threads = ctx.settings.limits.fetch_threads
    if all(is_local(it.ref) for it in chunk.items):
        return max(1, min(threads, os.cpu_count() or 1))
    return threads


def prepare(ctx: WorkerContext, chunk: Chunk, item: Item) -> Prepared:
    """Fetch and hash (and render a PDF); a plain image's decode waits for the cache check."""
    data = fetch(item.ref, ctx.settings.limits, s3_client=ctx.s3_client, store=ctx.store, job=chunk.job)
    sha = sha256_hex(data)

    def key(content: str) -> str:
        return keys.cache_key(content, ctx.engine.revision, *chunk.spec(item))

    if is_pdf(data):  # PDF pages: cached page by page, by their pixels
        pages = decode_bytes(ctx, data)
        return Prepared(item, sha, [Unit(key(pg.digest or sha), [pg]) for pg in pages], document=True)
    return Prepared(item, sha, [Unit(key(sha), [])], data)


def decode_miss(ctx: WorkerContext, prep: Prepared) -> None:
    """Decode a plain image whose cache entry was missing (typed errors: BadImage, ...)."""
    prep.units[0].pages = decode_bytes(ctx, prep.data)
    prep.data = b""


def decode_misses(ctx: WorkerContext, misses: Sequence[Prepared]) -> list[Exception | None]:
    """Decode a chunk's plain images that missed the cache: one error (or None) per image.

    The images go to the decoder in ``decoder.parallelism`` groups, each one ``decode_many``
    call in the fetch pool: with isolation, one round trip to a child per group instead of one
    per image."""
    decoder = ctx.decoder
    if decoder is None:
        return fan_out(ctx.fetch_pool, ctx.settings.limits.fetch_threads, lambda p: decode_miss(ctx, p), misses)
    n = min(decoder.parallelism, len(misses))
    groups = [misses[g::n] for g in range(n)]
    outcomes = fan_out(ctx.fetch_pool, n, lambda group: decoder.decode_many([p.data for p in group]), groups)
    errors: list[Exception | None] = [None] * len(misses)
    for g, (group, got) in enumerate(zip(groups, outcomes, strict=True)):
        for k, prep in enumerate(group):
            outcome = got if isinstance(got, Exception) else got[k]  # a whole group's failure: each image's
            if isinstance(outcome, Exception):
                errors[g + k * n] = outcome
            else:
                prep.units[0].pages, prep.data = outcome, b""
    return errors


def on_page(output: OcrOutput, page: int) -> OcrOutput:
    """The engine's output as page ``page`` of its image (copied only when the index differs:
    a shared in-flight future's output is never mutated)."""
    return output if output.page == page else output.model_copy(update={"page": page})


def assemble(prep: Prepared, hits: dict[str, list[OcrOutput]], computed: dict[int, list[OcrOutput]],
             shared: set[int], max_pages: int) -> tuple[list[OcrOutput], bool]:
    """An image's outputs in page order, and whether none of them ran the engine for it
    (``computed`` / ``shared``: by unit number, for the units that missed the cache)."""
    outs: list[OcrOutput] = []
    cached = True
    for n, unit in enumerate(prep.units):
        if unit.cache_key in hits:
            source = hits[unit.cache_key]
        else:
            source = computed[n]
            cached = cached and n in shared
        if prep.document:  # a page cached from another document: this document's page number
            outs += [o.model_copy(update={"page": pg.index, "meta": {**o.meta, "cache_key": unit.cache_key}})
                     for o, pg in zip(source, unit.pages, strict=False)]
        else:
            # the entry's outputs carry their page numbers; an entry cached under a larger
            # max_pages is cut to today's (one cached with fewer frames is used as is)
            outs += source[:max_pages]
    return outs, cached
