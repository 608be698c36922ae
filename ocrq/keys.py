"""Every Redis key, S3/local-store prefix and deterministic id ocrq uses, in one place.

Redis (all under ``ocrq:``; Celery's own keys — the queue lists named after ``settings.queue.name``,
``unacked``, ``unacked_index``, ``unacked_mutex``, ``_kombu.binding.*``, ``celery-task-meta-*`` —
live beside them in the same database). Redis holds what is in flight; a finished job's per-image
state is in the store. For each key: what it holds, then how it grows and what bounds it.

    ocrq:jobs                  ZSET  job name -> created (epoch s)
        per job; members older than job_ttl are trimmed at each create
    ocrq:tenant:{tenant}:jobs  ZSET  the tenant's jobs -> created (the API's list, newest first;
                                     ``ocrq.names``: the default tenant's jobs are unqualified)
        per job of the tenant; members older than job_ttl are trimmed at each create
    ocrq:job:{job}             HASH  meta: task, params, queue, priority (reprocess re-publishes
                                     there), exports, skipped (+ sample), created, archived,
                                     epoch and parts (the result parts' names: ocrq.output.parts),
                                     cancelled (when), what the API keeps of a job (webhook
                                     URL, metadata, object: job or batch), engine:{kind} ->
                                     "cpu"|"gpu" per engine kind that ran it (ocrq.jobs.progress: what
                                     its cost was measured on)
        per job; job_ttl (30 d)
    ocrq:job:{job}:counts      HASH  status -> n, total, cached; engine_s, engine_images,
                                     batches, last_done (what it cost); exact (one Lua script)
        per job; job_ttl
    ocrq:job:{job}:images      HASH  image id -> a marker (d/c/f + the number of the part that
                                     holds its document, p, q{submission}) or the
                                     ImageRecord JSON of an image a worker is on
        per image of a running job; deleted when the job is archived (finished and exported),
        else job_ttl
    ocrq:job:{job}:failed      ZSET  image id -> failed at (epoch s): the job's failed registry
        per failed image of a running job; deleted with the records, else job_ttl
    ocrq:job:{job}:feed        HASH  the job's submissions (sub:{id} -> ordinal, windows, task,
                                     params, queue, priority) and, per submission, its shards
                                     written and fed (ocrq.jobs.feed)
        per submission; deleted when the job is archived, else job_ttl
    ocrq:feeding               SET   jobs with a shard written and not yet fed
        per job being fed; a job leaves once every shard is fed
    ocrq:job:{job}:progress    HASH  display only, between chunk records (ocrq.jobs.progress): engine ->
                                     images the engine finished; t{window} -> images finished in
                                     that 5 s window (engine, plus recorded hits and failures)
        per running job; at most 120 windows (10 min) + 1 field, a few KB; 1 d after its last progress
    ocrq:job:{job}:submitting  STR   set while a producer records and writes a submission's refs
                                     (fed window by window as they are written): the job cannot
                                     finish, so no export of half a submission
        per job being submitted; deleted at the end, else 600 s (refreshed per window of refs)
    ocrq:job:{job}:finishing   STR   set (NX) by the worker that saw the job complete and
                                     published its export (its value: when, epoch s; the export
                                     sweep asks again once it is redis.export_stale_s old and
                                     the job is not archived); cleared by new work (submit, reprocess)
        per job; job_ttl
    ocrq:exports:sweep         STR   held (NX) by the worker sweeping for finished jobs without
                                     their export (worker.export_sweep)
        one key; TTL redis.export_sweep_s
    ocrq:hot                   HASH  the hot cache's state: current generation, bytes written
        one key (on redis.cache_url); cache_ttl
    ocrq:hot:{generation}      HASH  cache key -> OcrOutput list JSON (hot copy)
        per cache entry; all generations together hold at most redis.cache_max_bytes (two live,
        worker.cache); cache_ttl
    ocrq:events                HASH  webhook events not yet delivered nor given up: event id
                                     ({job}#{n}) -> its JSON (type, job, url, attempts, payload
                                     once built: ``ocrq.jobs.events``); written with the job's archive
        per pending event; an event leaves once delivered or given up (api.webhook_retry_s)
    ocrq:events:due            ZSET  pending event id -> when its next attempt is due (a deliverer
                                     claims one by moving it a claim window ahead)
        per pending event; it leaves once delivered or given up
    ocrq:job:{job}:deliveries  LIST  the job's webhook attempts, newest first (JSON: event, type,
                                     attempt, at, HTTP status or error, seconds)
        per attempt; capped at 100 (LTRIM); job_ttl
    ocrq:idempotency:{tenant}:{digest} STR  an Idempotency-Key's job and the digest of the request
                                     that made it (``api``)
        per key; api.idempotency_ttl_s (24 h)
    ocrq:rate:{tenant}:{second} STR  the tenant's API requests in that second (``api``)
        per tenant; 2 s
    ocrq:tenant:{tenant}:active SET  the tenant's jobs that may have images in flight (the API's
                                     check of ``max_in_flight``); a final job leaves when met
        per running job of the tenant; a final job leaves when the check meets it
    ocrq:tenant:{tenant}:files ZSET  the tenant's uploaded files (OpenAI Files: ``api``) -> created
        per file; members older than job_ttl trimmed at each upload
    ocrq:file:{tenant}:{id}    HASH  one uploaded file: name, bytes, purpose, created, store path
        per file; job_ttl
    ocrq:tenant:{tenant}:batches ZSET  the tenant's OpenAI batches (each a job) -> created
        per batch; members older than job_ttl trimmed at each create
    ocrq:workers:{hostname}    STR   governor/engine state for metrics, the worker's allowed roots
                                     (producers check local refs against them at submit), its
                                     process (host, pid, var dir: ocrq up/down tell stacks apart),
                                     its queues and its engine's capabilities (kind, device,
                                     tasks, custom prompts: producers refuse what none can run)
        per worker; 60 s, refreshed
    ocrq:governor:{fingerprint} STR  governor snapshot (learned memory model)
        per model, engine settings and device size; 30 d, refreshed
    ocrq:held:{hostname}       SET   delivery tags the worker holds unacked
        per worker (its prefetch window); dead_worker_s, refreshed 1/s
    ocrq:reaper:suspects       HASH  unclaimed old unacked tag -> first seen
        per unacked message of a dead worker; entries leave with the tag; 1 d, refreshed per sweep
    ocrq:consumers:{queue}     ZSET  worker hostname -> last seen (epoch s)
        per worker; 1 h, refreshed 1/s
    ocrq:ring:{queue}          LIST  wake-up tokens, one pushed beside each published message;
                                     workers BRPOP it, then claim a message (ocrq.broker.transport)
        per published message; capped at 10,000

Celery's keys: a queue list holds the messages of what was fed and not yet taken (one per chunk
of ``queue.chunk_size`` refs; at most ``queue.window`` images of each job: ``ocrq.jobs.feed``);
``unacked``/``unacked_index`` hold the chunks workers have taken and not acknowledged (bounded by
the workers' prefetch windows). Chunk and export tasks store no result (``ignore_result``): no
``celery-task-meta-*`` per chunk.

Durable store (S3 ``s3://{bucket}/{prefix}``, or these paths as rows of the local store's database
``{store.path}/store.sqlite3``, ``ocrq.store.sqlite_store``; a job's export stays plain files under
``{store.path}`` there, for the tools that read it):

    {prefix}cache/{cache key}.json          OcrOutput list, content-addressed (cache of record)
    {prefix}jobs/{job}/refs/{sub}/{n}.jsonl  a submission's refs, window n (``ocrq.jobs.feed``): one JSON
                                            line [image id, ref, manifest row] per image it added
                                            (+ its own {task, params}: an OpenAI Batch line's);
                                            deleted when the job is archived
    {prefix}results/{job}/parts/{epoch}-{n}.jsonl  ImageResult lines: the final images of one
                                            stored chunk (``ocrq.output.parts``); one PUT per chunk
    {prefix}results/{job}/index.json        written at export: the parts that hold the job's
                                            current documents, and the lines in them that a later
                                            part replaced (an archived job is read through it)
    {prefix}results/{job}/{image id}.json   ImageResult of one image, as written before result
                                            parts (read, never written)
    {prefix}failed/{job}/{image id}.json    durable mirror of the failed registry: the failed
                                            record + task, params (``ocrq failed --from-store``);
                                            deleted when the image is reprocessed
    {prefix}results/{job}/export/results.jsonl    every result line of the job (written at completion)
    {prefix}results/{job}/export/results.parquet  the same rows, when the job asked for Parquet
    {prefix}results/{job}/export/_SUCCESS   written last: the export is complete (JSON: counts, files)
    {prefix}files/{tenant}/{file id}        a file uploaded through the API (an OpenAI Batch input
                                            file); deleted by ``DELETE /v1/files/{id}``, else kept
                                            (the bucket's lifecycle rules bound it)
    {prefix}inputs/{job}/{sha256}           an inline image (a ``data:`` URI of an OpenAI Batch line)
                                            of one job, content-addressed within it, submitted as
                                            ``store:inputs/{job}/{sha256}``; a worker reads it only for
                                            a chunk of that job (``producer.inline_images``, ``ocrq.net.fetch``)
    {prefix}results/{job}/openai-batch/rejected/{file}.jsonl  the error lines of an OpenAI Batch
                                            file's lines that could not run (``{file}``: the file's
                                            sha256[:16]); one object per file submitted
    {prefix}results/{job}/export/openai-batch/output.jsonl  the job's lines done, as OpenAI Batch
                                            output (``ocrq.output.openai_responses``)
    {prefix}results/{job}/export/openai-batch/errors.jsonl  its lines failed or rejected, as the
                                            OpenAI Batch error file
    {prefix}results/{job}/export/openai-batch/_SUCCESS  written last, once every line is final

OpenAI Batch files keep no per-line state in Redis: a line's ``custom_id`` is its image's manifest
row (``{"custom_id": ...}``, so it is part of the image id and comes back in its result), held
by the submission's ref shards and the result documents in the store, like any row; its own task
and params ride in its shard line (a fourth element) and its chunk message. Per line of a file the
store grows by that row in one shard line and one result document, plus one ``inputs/`` object
per distinct inline image of the job and one error line per rejected line; Redis holds only the per-image
marker every submission has, until the job is archived.

The store is the history: per image of a job it grows by one result document (a line of a
part: one object per chunk) and, on a first read of the bytes, one cache entry (plus a failed
mirror per failed image, deleted when the image is reprocessed); per job by its export and its
results index. A first pass writes 1 + 1/chunk PUTs per image (the cache entry and its share of
a part). ocrq never deletes results: what bounds them is the bucket's lifecycle rules (S3) or the
operator (the local store).

Ids: image id = sha256(job NUL ref)[:32] (plus NUL + the manifest row's JSON when the ref came with
extra columns, so two rows naming one file stay two results); chunk task id = sha256(job NUL first id NUL n)[:32];
cache key = sha256(image bytes) . engine revision . task . sha256(params)[:16]; for a PDF page,
sha256 of the rendered page (size, mode, pixels) stands in for the bytes, so the same page inside
two PDFs is one cache entry (so re-submitting the same (job, ref) or the same bytes is a no-op / cache hit).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from ocrq.errors import RefusedKey
from ocrq.names import shown

PREFIX = "ocrq:"
JOBS = PREFIX + "jobs"
#: held by the worker sweeping for finished jobs without their export (worker.export_sweep)
EXPORT_SWEEP = PREFIX + "exports:sweep"
#: the hot cache's state: its current generation and the bytes written into it (worker.cache)
HOT_STATE = PREFIX + "hot"


def job(job_name: str) -> str:
    return f"{PREFIX}job:{job_name}"


def tenant_jobs(tenant: str) -> str:
    """The tenant's jobs by creation time (``ocrq.names``: a tenant's job names are qualified)."""
    return f"{PREFIX}tenant:{tenant}:jobs"


#: webhook events not yet delivered (event id -> JSON) and when each is due (ocrq.jobs.events)
EVENTS = PREFIX + "events"
EVENTS_DUE = PREFIX + "events:due"
#: attempts kept per job in its deliveries list
DELIVERIES_KEPT = 100


def job_deliveries(job_name: str) -> str:
    """The job's webhook attempts, newest first (ocrq.jobs.events)."""
    return f"{PREFIX}job:{job_name}:deliveries"


def idempotency(tenant: str, digest: str) -> str:
    """An Idempotency-Key of ``tenant`` (``digest``: sha256 of the key) -> its job and request."""
    return f"{PREFIX}idempotency:{tenant}:{digest}"


def rate(tenant: str, second: int) -> str:
    """``tenant``'s API requests in epoch second ``second``."""
    return f"{PREFIX}rate:{tenant}:{second}"


def tenant_active(tenant: str) -> str:
    """The tenant's jobs that may still have images in flight."""
    return f"{PREFIX}tenant:{tenant}:active"


def tenant_files(tenant: str) -> str:
    return f"{PREFIX}tenant:{tenant}:files"


def file_meta(tenant: str, file_id: str) -> str:
    return f"{PREFIX}file:{tenant}:{file_id}"


def tenant_batches(tenant: str) -> str:
    return f"{PREFIX}tenant:{tenant}:batches"


def job_images(job_name: str) -> str:
    return f"{PREFIX}job:{job_name}:images"


def job_counts(job_name: str) -> str:
    return f"{PREFIX}job:{job_name}:counts"


def job_feed(job_name: str) -> str:
    """The job's submissions and how far each is fed (ocrq.jobs.feed)."""
    return f"{PREFIX}job:{job_name}:feed"


#: jobs with a submission shard written and not yet fed: what every worker's feeder looks at
FEEDING = PREFIX + "feeding"


def job_progress(job_name: str) -> str:
    """What workers' engines finished of the job since its last records, and how fast: display
    only (ocrq.jobs.progress)."""
    return f"{PREFIX}job:{job_name}:progress"


def job_submitting(job_name: str) -> str:
    return f"{PREFIX}job:{job_name}:submitting"


def job_finishing(job_name: str) -> str:
    return f"{PREFIX}job:{job_name}:finishing"


def job_failed(job_name: str) -> str:
    """The job's failed registry while it runs (image id -> failed at); the store's mirror
    (``failed_object``) is the record once the job is archived."""
    return f"{PREFIX}job:{job_name}:failed"


def hot_generation(generation: int) -> str:
    """One generation of the hot cache (cache key -> outputs JSON); ``HOT_STATE`` says which is
    current (worker.cache)."""
    return f"{PREFIX}hot:{generation}"


def worker_state(hostname: str) -> str:
    return f"{PREFIX}workers:{hostname}"


def held_tags(hostname: str) -> str:
    """The broker delivery tags worker ``hostname`` holds unacked: its claim on them. When the
    key expires (no refresh for ``redis.dead_worker_s``) the reaper may put them back
    (worker.reaper)."""
    return f"{PREFIX}held:{hostname}"


#: unacked delivery tags no live worker claims, with when a sweep first saw them (worker.reaper)
REAPER_SUSPECTS = PREFIX + "reaper:suspects"

#: Celery's (kombu's) own keys for the messages workers took and did not ack: delivery tag ->
#: [message, exchange, routing key], and delivery tag -> when it was delivered. The transport
#: writes them under these names (ocrq.broker.transport); the reaper, the prefetch step and the
#: metrics read them
CELERY_UNACKED = "unacked"
CELERY_UNACKED_INDEX = "unacked_index"


def queue_consumers(queue: str) -> str:
    """Workers consuming ``queue``, scored by when each last said so (once a second): how many
    share it, so each reserves an equal share of a shallow queue (worker.prefetch)."""
    return f"{PREFIX}consumers:{queue}"


def queue_ring(queue: str) -> str:
    """Wake-up tokens for ``queue``'s consumers (ocrq.broker.transport): a hint, never the message."""
    return f"{PREFIX}ring:{queue}"


#: a queue's consumer set outlives its last worker by this long
QUEUE_CONSUMERS_TTL_S = 3600


def governor_profile(fingerprint: str) -> str:
    """Where workers keep what their governor learned, shared by every worker whose model,
    engine settings and device capacity hash to ``fingerprint`` (``governor_fingerprint``): the
    workers of identical GPUs share one, the most-informed save wins (docs/gpu.md)."""
    return f"{PREFIX}governor:{fingerprint}"


#: how long a governor snapshot outlives the last worker that refreshed it
GOVERNOR_PROFILE_TTL_S = 30 * 86400


# --- durable store paths (relative to the store prefix) -------------------------------------

#: the longest store path (S3 keys are at most 1,024 bytes, the store's prefix included)
MAX_STORE_PATH = 960
#: characters no store path holds: control characters and the backslash (a separator on Windows
#: tools that read an export)
_BAD_PATH_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")


def check_store_path(path: object, *, prefix: bool = False) -> str:
    """``path`` when it names something under a store's root, else ``RefusedKey``: every store
    (local files, SQLite, S3) calls it on every path it is given, whoever the caller. Relative,
    ``/``-separated, no empty, ``.`` or ``..`` segment, no control character, at most
    ``MAX_STORE_PATH`` bytes. ``prefix``: a listing prefix, which may be empty or end in ``/``."""
    if not isinstance(path, str):
        raise RefusedKey(f"a store path must be text, not {type(path).__name__}")
    if prefix and path == "":
        return path
    size = len(path.encode("utf-8", "surrogatepass"))
    if not path or size > MAX_STORE_PATH:
        raise RefusedKey(f"store path of {size} bytes (1 to {MAX_STORE_PATH})")
    segments = path.split("/")
    if prefix and segments[-1] == "":
        segments.pop()
    if path.startswith("/") or any(seg in ("", ".", "..") for seg in segments) or _BAD_PATH_CHARS.search(path):
        raise RefusedKey(f"store path {shown(path)} leaves the store's root or is malformed "
                         "(relative, '/'-separated, no '', '.' or '..' segment, no control character)")
    return path


def cache_object(cache_key: str) -> str:
    return f"cache/{cache_key}.json"


def refs_prefix(job_name: str) -> str:
    return f"jobs/{job_name}/refs/"


def refs_shard(job_name: str, submission: str, window: int) -> str:
    return refs_prefix(job_name) + f"{submission}/{window:06d}.jsonl"


def result_object(job_name: str, image_id: str) -> str:
    """One image's document as ocrq wrote it before result parts (still read: ``ocrq.output.parts``)."""
    return f"results/{job_name}/{image_id}.json"


def result_part(job_name: str, epoch: str, n: int) -> str:
    """The documents of the final images of one stored chunk (``ocrq.output.parts``): ``epoch`` is the
    job's (``ocrq:job:{job}`` ``epoch``, new when the job's meta is new), ``n`` its part counter."""
    return f"results/{job_name}/parts/{epoch}-{n:08d}.jsonl"


def results_index(job_name: str) -> str:
    """Which parts hold a finished job's current documents (``ocrq.output.parts``), written at export."""
    return f"results/{job_name}/index.json"


def results_prefix(job_name: str) -> str:
    return f"results/{job_name}/"


FAILED_OBJECTS = "failed/"


def failed_object(job_name: str, image_id: str) -> str:
    return f"{FAILED_OBJECTS}{job_name}/{image_id}.json"


#: file names of a job's export (under ``export_prefix``); ``_SUCCESS`` is always written last
EXPORT_JSONL = "results.jsonl"
EXPORT_PARQUET = "results.parquet"
EXPORT_SUCCESS = "_SUCCESS"


def export_prefix(job_name: str) -> str:
    return f"results/{job_name}/export/"


def export_object(job_name: str, name: str) -> str:
    return export_prefix(job_name) + name


def is_export_object(path: str) -> bool:
    """Whether ``path`` is a file of a job's export (``results/{job}/export/...``, its OpenAI Batch
    files included)."""
    parts = path.split("/")
    return (parts[0] == "results" and len(parts) >= 4 and parts[2] == "export"
            and (len(parts) == 4 or (len(parts) == 5 and parts[3] == OPENAI_BATCH)))


#: the OpenAI Batch export's folder under ``export_prefix`` and its file names
OPENAI_BATCH = "openai-batch"
OPENAI_OUTPUT = "output.jsonl"
OPENAI_ERRORS = "errors.jsonl"


def openai_export_object(job_name: str, name: str) -> str:
    """A file of the job's OpenAI Batch export: ``OPENAI_OUTPUT``, ``OPENAI_ERRORS`` or
    ``EXPORT_SUCCESS`` (written last)."""
    return f"{export_prefix(job_name)}{OPENAI_BATCH}/{name}"


def openai_rejected_prefix(job_name: str) -> str:
    return f"results/{job_name}/{OPENAI_BATCH}/rejected/"


def openai_rejected(job_name: str, file_digest: str) -> str:
    """The error lines of the lines of one submitted OpenAI Batch file that could not run."""
    return f"{openai_rejected_prefix(job_name)}{file_digest}.jsonl"


def uploaded_file(tenant: str, file_id: str) -> str:
    """A file uploaded through the API (``POST /v1/files``): the tenant's own folder."""
    return f"files/{tenant}/{file_id}"


def inline_input(job_name: str, content_sha256: str) -> str:
    """An inline image's bytes, of job ``job_name`` (``producer.inline_images``): a ``store:`` ref
    names this path, and only that job's chunks may read it (``ocrq.net.fetch``)."""
    return f"inputs/{job_name}/{content_sha256}"


# --- deterministic ids -----------------------------------------------------------------------

def _sha(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def image_id(job_name: str, ref: str, row: Mapping[str, Any] | None = None) -> str:
    if not row:
        return _sha(job_name, ref)[:32]
    return _sha(job_name, ref, json.dumps(dict(row), sort_keys=True, default=str))[:32]


def chunk_id(job_name: str, first_image_id: str, n: int) -> str:
    return _sha(job_name, first_image_id, str(n))[:32]


def governor_fingerprint(revision: str, engine_settings: Mapping[str, Any], capacity_bytes: int | None) -> str:
    """Memory behaviour is a function of the weights, the engine settings (tokens, pixels, decode
    mode, chunking) and the device size: any change starts a fresh calibration."""
    blob = json.dumps([revision, dict(engine_settings), capacity_bytes], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def params_digest(params: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(dict(params), sort_keys=True).encode()).hexdigest()[:16]


def cache_key(content_sha256: str, revision: str, task: str, params: Mapping[str, Any]) -> str:
    safe_rev = revision.replace("/", "_").replace(":", "_")
    return f"{content_sha256}.{safe_rev}.{task}.{params_digest(params)}"
