"""Step 5: what the attempt found, stored before the message is acked (Celery acks when the task
returns):

1. each image's outputs in page order, from its hits and the units computed for it, and its
   record; each error settled (another attempt, or failed for good: worker.chunk.records);
2. one store call: a durable cache entry per unit the engine ran for this chunk, one result part
   holding the documents of the chunk's final images (``ocrq.output.parts``; its number goes into
   their markers) and, per failed image, the failed registry's durable mirror (losing Redis does
   not lose what failed); then the hot copies (worker.cache);
3. the job index: the records and exact counts, in one script.

Pages computed for a document whose other page failed are cached too (its retry hits them); the
outputs carry their page numbers: an entry is stored as computed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ocrq import keys
from ocrq.errors import NameTaken
from ocrq.messages import Chunk, Item
from ocrq.results import ImageRecord, ImageResult, ImageStatus, OcrOutput
from worker.chunk.attempt import Attempt, Fetched
from worker.chunk.needs import Worker
from worker.chunk.records import engine_share, image_record, settle
from worker.chunk.report import ChunkReport, failure

log = logging.getLogger("ocrq.worker")

#: part numbers tried before a chunk's documents give up (and the chunk is retried): a number is
#: taken only where Redis handed it out before and then lost its counter (a failover, a crash)
PART_TRIES = 64

#: a store call: (path, document or bytes) writes, and the paths only created (``ResultStore.put_many``)
Put = Callable[[list[tuple[str, Any]], Collection[str]], None]


@dataclass(frozen=True)
class Stored:
    """The attempt's report, and how many result documents were written."""

    report: ChunkReport
    documents: int


def store(ctx: Worker, attempt: Attempt) -> Stored:
    """Store the attempt's outcome (see the module's docstring)."""
    chunk = attempt.chunk
    records, docs, report = _outcomes(ctx, attempt)
    entries = ctx.cache.encode({attempt.images[i].units[n].cache_key: outs
                                for (i, n), outs in attempt.computed.items() if (i, n) not in attempt.shared})
    cache_writes = ctx.cache.durable_writes(entries)

    def put(more: list[tuple[str, Any]], new: Collection[str]) -> None:  # one store call (one SQLite transaction)
        if cache_writes or more:
            ctx.store.put_many(cache_writes + more, new=new)

    part, writes = write_documents(ctx, chunk, docs, put)
    ctx.cache.warm(entries)  # (after the durable copies: a hot entry always has one)
    ctx.index.record(records, requests=(len(entries) + len(writes), attempt.store_reads), part=part)
    ctx.metrics.observe_records(chunk.task, records, attempt.elapsed())
    if ctx.progress is not None:  # final without the engine (its finished images were counted as they finished)
        ctx.progress.recorded(chunk.job, report.cached + report.failed)
    return Stored(report, len(docs))


def _outcomes(ctx: Worker, attempt: Attempt) -> tuple[list[ImageRecord], list[ImageResult], ChunkReport]:
    """Every image's record, the documents of the final ones, and the report."""
    chunk = attempt.chunk
    computed_units: dict[str, list[int]] = {}
    for i, n in attempt.computed:
        computed_units.setdefault(i, []).append(n)
    records: list[ImageRecord] = []
    docs: list[ImageResult] = []
    retry: list[Item] = []
    failures = []
    done = cached = 0
    for item in chunk.items:
        image = attempt.images.get(item.id)
        err = attempt.errors.get(item.id)
        if err is not None:
            settled = settle(ctx.settings.queue.max_attempts, chunk, item, err, image, ctx.hostname)
            rec = settled.record
            if settled.retry is not None:
                retry.append(settled.retry)
            if settled.failure is not None:
                failures.append(failure(item, settled.failure))
                docs.append(ImageResult(record=rec))
        else:
            assert image is not None
            mine = computed_units.get(item.id, [])
            outs, from_cache = assemble(image, attempt.hits, {n: attempt.computed[(item.id, n)] for n in mine},
                                        {n for n in mine if (item.id, n) in attempt.shared},
                                        ctx.settings.limits.max_pages)
            rec = image_record(chunk, item, ImageStatus.done, None, image, cached=from_cache, pages=len(outs),
                               worker=ctx.hostname, **({} if from_cache else engine_share(outs)))
            done += 1
            cached += from_cache
            docs.append(ImageResult(record=rec, outputs=outs))
        records.append(rec)
    return records, docs, ChunkReport(done=done, cached=cached, failed=len(failures), retry=tuple(retry),
                                      failures=tuple(failures))


def assemble(image: Fetched, hits: Mapping[str, list[OcrOutput]], computed: dict[int, list[OcrOutput]],
             shared: set[int], max_pages: int) -> tuple[list[OcrOutput], bool]:
    """An image's outputs in page order, and whether none of them ran the engine for it
    (``computed`` / ``shared``: by unit number, for the units that missed the cache)."""
    outs: list[OcrOutput] = []
    cached = True
    for n, unit in enumerate(image.units):
        if unit.cache_key in hits:
            source = hits[unit.cache_key]
        else:
            source = computed[n]
            cached = cached and n in shared
        if image.document:  # a page cached from another document: this document's page number
            outs += [o.model_copy(update={"page": pg.index, "meta": {**o.meta, "cache_key": unit.cache_key}})
                     for o, pg in zip(source, unit.pages, strict=False)]
        else:
            # the entry's outputs carry their page numbers; an entry cached under a larger
            # max_pages is cut to today's (one cached with fewer frames is used as is)
            outs += source[:max_pages]
    return outs, cached


def write_documents(ctx: Worker, chunk: Chunk, docs: list[ImageResult], put: Put
                    ) -> tuple[int | None, list[tuple[str, Any]]]:
    """Store a chunk's final images: one result part holding their documents (its number goes
    into their markers, returned) and, per failed image, the failed registry's durable mirror;
    (the part's number, the writes stored). ``put(writes, new)`` writes them, ``new`` (the part)
    only where its name is free: a name another chunk's documents hold is never replaced, the
    next number is taken."""
    if not docs:
        put([], ())
        return None, []
    body = b"\n".join(d.document_json() for d in docs) + b"\n"
    items = {it.id: it for it in chunk.items}
    for _ in range(PART_TRIES):
        epoch, part = ctx.index.new_part(chunk.job)
        path = keys.result_part(chunk.job, epoch, part)
        writes: list[tuple[str, Any]] = [(path, body)]
        writes += [(keys.failed_object(d.record.job, d.record.id), failed_entry(chunk, items[d.record.id], d.record,
                                                                                 path))
                   for d in docs if d.record.status == ImageStatus.failed]
        try:
            put(writes, (path,))
            return part, writes
        except NameTaken as exc:
            log.warning("! result part %s of job=%s is taken (Redis set its counter back): the next one, %s",
                        part, chunk.job, exc)
    raise NameTaken(f"job={chunk.job}: {PART_TRIES} result part numbers in a row were taken")


def failed_entry(chunk: Chunk, item: Item, rec: ImageRecord, document: str) -> dict[str, Any]:
    """The failed registry's durable mirror of one image (what ``ocrq failed --from-store`` reads,
    and ``ocrq reprocess`` re-runs with the image's own task and params); ``document``: the result
    part holding its document (``ocrq failed show`` reads it there)."""
    task, params = chunk.spec(item)
    return {"record": rec.model_dump(mode="json"), "task": task, "params": params,
            "failed_at": time.time(), "document": document}
