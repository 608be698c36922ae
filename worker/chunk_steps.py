"""The steps of one attempt at a chunk (``worker.tasks._process_chunk`` calls them in order), each
returning what the next needs as a typed value:

    fetch → Fetched → check_cache → CacheCheck → decode_misses → Decoded
          → infer → Inferred → store → Stored

An image that fails at a step is in that step's errors and goes no further; ``store`` settles it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from ocrq.capabilities import unsupported
from ocrq.errors import EngineTimeout, OcrqError, UnsupportedTask, classify
from ocrq.messages import Chunk
from ocrq.results import ImageRecord, ImageResult, ImageStatus, OcrOutput
from worker import prepare as prep
from worker.chunk_report import ChunkReport
from worker.context import WorkerContext
from worker.engines.base import OcrRequest
from worker.fanout import fan_out
from worker.loop.intake import Intake
from worker.prepare import Prepared, Unit
from worker.records import engine_share, image_record, settle, store_documents

#: (image id, unit number): one cache entry of one image (a file, or one page of a PDF)
UnitId = tuple[str, int]


@dataclass
class Fetched:
    """Step 1: every image fetched and hashed (PDFs rendered), or its typed error."""

    prepared: dict[str, Prepared]
    errors: dict[str, OcrqError]


@dataclass
class CacheCheck:
    """Step 2: the chunk's cache units and which of them hit (one MGET)."""

    units: list[tuple[str, int, Unit]]
    hits: dict[str, list[OcrOutput]]
    #: the store requests this attempt made, for the job's cost
    reads: list[int]
    #: units that hit (a key twice in the chunk counts twice)
    n_hits: int


@dataclass
class Decoded:
    """Step 3: how many plain images missed the cache and were decoded, and those that failed."""

    misses: int
    errors: dict[str, OcrqError]


@dataclass
class Inferred:
    """Step 4: the engine's outputs per unit that missed, which of them another request already
    had in flight (``shared``: not this chunk's engine work), and the images that failed there."""

    computed: dict[UnitId, list[OcrOutput]]
    shared: set[UnitId]
    errors: dict[str, OcrqError]
    #: units handed to the engine loop
    units: int


@dataclass
class Stored:
    """Step 5: the chunk's report and how many result documents were written."""

    report: ChunkReport
    documents: int


def fetch(ctx: WorkerContext, chunk: Chunk, refused: dict[str, OcrqError] | None = None) -> Fetched:
    """Fetch + hash in the fetch pool, a few groups per chunk (worker.fanout), overlapping other
    chunks' inference; typed errors from refs/documents, anything else classified. The images
    the message refused (``ocrq.messages.read_chunk``) are never fetched: their error stands,
    nor those of a task or prompt this engine cannot honour (typed ``UnsupportedTask``)."""
    fetched = Fetched({}, dict(refused or {}))
    caps = ctx.capabilities()
    todo = []
    for it in chunk.items:
        if it.id in fetched.errors:
            continue
        why = unsupported(caps, *chunk.spec(it))
        if why is None:
            todo.append(it)
        else:
            fetched.errors[it.id] = UnsupportedTask(f"{why}: it runs {', '.join(caps['tasks'])}"
                                                    + ("" if caps["custom_prompt"] else ", without custom prompts"))
    outcomes = fan_out(ctx.fetch_pool, prep.fetch_groups(ctx, chunk), lambda it: prep.prepare(ctx, chunk, it),
                       todo)
    for it, outcome in zip(todo, outcomes, strict=True):
        if isinstance(outcome, Exception):
            fetched.errors[it.id] = classify(outcome)
        else:
            fetched.prepared[it.id] = outcome
    return fetched


def check_cache(ctx: WorkerContext, prepared: dict[str, Prepared]) -> CacheCheck:
    """One MGET for the chunk (files, and PDF pages one by one); hits are neither decoded nor sent
    to the engine."""
    units = [(item_id, n, unit) for item_id, p in prepared.items() for n, unit in enumerate(p.units)]
    reads: list[int] = []
    hits = ctx.cache.get_many([unit.cache_key for _, _, unit in units], reads)
    n_hits = sum(unit.cache_key in hits for _, _, unit in units)
    ctx.metrics.observe_cache(n_hits, len(units) - n_hits)
    return CacheCheck(units, hits, reads, n_hits)


def decode_misses(ctx: WorkerContext, prepared: dict[str, Prepared], cache: CacheCheck) -> Decoded:
    """Validate (decode) the plain images that missed, in the fetch pool and through the isolated
    decoder (worker.decoding.decode: a few batches per chunk); a bad image fails here, typed. A
    hit is never decoded: its bytes go now."""
    misses = [p for p in prepared.values() if not p.document and p.units[0].cache_key not in cache.hits]
    for p in prepared.values():
        if p.data and p.units[0].cache_key in cache.hits:
            p.data = b""
    return Decoded(len(misses), {p.item.id: classify(bad)
                                 for p, bad in zip(misses, prep.decode_misses(ctx, misses), strict=True)
                                 if bad is not None})


def infer(ctx: WorkerContext, chunk: Chunk, prepared: dict[str, Prepared], cache: CacheCheck,
          errors: dict[str, OcrqError], intake: Intake, deadline: float) -> Inferred:
    """Every page that missed goes to the engine loop (one hand-off for the chunk), whose governor
    forms the micro-batches; then one wait for all of them, bounded by the chunk's ``deadline``
    (the threads pool has no Celery time limits: an image still in the engine then is retried,
    and its retry joins the same in-flight future)."""
    todo = [(i, n, unit) for i, n, unit in cache.units if unit.cache_key not in cache.hits and i not in errors]
    to_run = [(i, n, k, unit.cache_key, pg) for i, n, unit in todo for k, pg in enumerate(unit.pages)]
    submitted = ctx.submit_once_many([
        (f"{key}#{k}", OcrRequest(f"{i}#{pg.index}", pg.image, *chunk.spec(prepared[i].item),
                                   priority=chunk.priority))
        for i, _, k, key, pg in to_run])
    intake.close()
    pending: dict[UnitId, list[Future[OcrOutput]]] = {(i, n): [] for i, n, _ in todo}
    # same content already in flight (here or in another chunk): the engine runs once, the rest are hits
    all_shared = dict.fromkeys(pending, True)
    for (i, n, _, _, _), (fut, was_shared) in zip(to_run, submitted, strict=True):
        pending[(i, n)].append(fut)
        all_shared[(i, n)] = all_shared[(i, n)] and was_shared
    inferred = Inferred({}, {u for u, was in all_shared.items() if was}, {}, len(pending))
    if ctx.progress is not None:  # each image as the engine finishes it, for those following the job
        by_image: dict[str, list[Future[OcrOutput]]] = {}
        for unit, futures in pending.items():
            if not all_shared[unit]:
                by_image.setdefault(unit[0], []).extend(futures)
        ctx.progress.watch(chunk.job, by_image.values())
    # one wake-up when the chunk's last page is done (not one per engine batch: with batches of 4,
    # the thread slept and woke for every 4 images)
    wait([f for futures in pending.values() for f in futures], timeout=max(0.0, deadline - time.monotonic()))
    for (item_id, n), page_futures in pending.items():
        if item_id in inferred.errors:  # another page of this document already failed
            continue
        try:
            inferred.computed[(item_id, n)] = [
                prep.on_page(f.result(timeout=max(0.0, deadline - time.monotonic())), pg.index)
                for f, pg in zip(page_futures, prepared[item_id].units[n].pages, strict=True)
            ]
        except FutureTimeout:
            inferred.errors[item_id] = EngineTimeout(f"no engine result within {ctx.settings.queue.time_limit}s")
        except Exception as exc:
            inferred.errors[item_id] = classify(exc)
    return inferred


def store(ctx: WorkerContext, chunk: Chunk, worker: str | None, prepared: dict[str, Prepared], cache: CacheCheck,
          inferred: Inferred, errors: dict[str, OcrqError], t0: float) -> Stored:
    """Cache entries (durable + hot) and one result document per final image (one store call),
    then the job index. Pages computed for a document whose other page failed are cached too (its
    retry hits them); the outputs carry their page numbers: an entry is stored as computed."""
    computed_units: dict[str, list[int]] = {}
    for i, n in inferred.computed:
        computed_units.setdefault(i, []).append(n)
    report = ChunkReport()
    records: list[ImageRecord] = []
    docs: list[ImageResult] = []
    max_pages = ctx.settings.limits.max_pages
    for item in chunk.items:
        got = prepared.get(item.id)
        if item.id in errors:
            rec = settle(ctx, chunk, item, errors[item.id], got, worker, report)
            if rec.status is ImageStatus.failed:
                docs.append(ImageResult(record=rec))
        else:
            assert got is not None
            mine = computed_units.get(item.id, [])
            outs, cached = prep.assemble(got, cache.hits, {n: inferred.computed[(item.id, n)] for n in mine},
                                         {n for n in mine if (item.id, n) in inferred.shared}, max_pages)
            rec = image_record(chunk, item, ImageStatus.done, None, got, cached=cached, pages=len(outs),
                               worker=worker, **({} if cached else engine_share(outs)))
            report.done += 1
            report.cached += cached
            docs.append(ImageResult(record=rec, outputs=outs))
        records.append(rec)
    entries = {prepared[i].units[n].cache_key: outs for (i, n), outs in inferred.computed.items()
               if (i, n) not in inferred.shared}
    part, writes = store_documents(ctx, chunk, docs,
                                   lambda writes, new: ctx.cache.put_many(entries, documents=writes, new=new))
    ctx.index.record(records, requests=(len(entries) + len(writes), sum(cache.reads)), part=part)
    ctx.metrics.observe_records(chunk.task, records, time.monotonic() - t0)
    if ctx.progress is not None:  # final without the engine (its finished images were counted as they finished)
        ctx.progress.recorded(chunk.job, report.cached + report.failed)
    return Stored(report, len(docs))
