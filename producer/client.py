"""The producer API: submit references, follow a job, read its results.

    client = Client(settings)
    job = client.submit(["s3://bucket/scans/", "manifest.jsonl"], job="invoices-2026-11")
    job.wait()
    for result in job.results(): ...

Submitting first plans the intake (``producer.intake``): every file found is accepted, skipped (by the
documented rule) or refused, and a submission with any refused ref publishes nothing. Then it
reads the accepted refs (spooled on disk: millions are fine) twice: it records each image as
``queued`` in the job index, then publishes chunks of ``queue.chunk_size`` refs per message. Image ids derive
from (job, ref), and chunk task ids from their contents, so submitting the same job again only
re-publishes images that are not finished; finished ones are left alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import redis

from ocrq import keys, markers, names
from ocrq.broker import publish, redis_conn
from ocrq.broker.queue import make_celery
from ocrq.capabilities import refusal
from ocrq.jobs.feed import WINDOW, Feed, Submission, read_entries, shard_bytes, submission_id
from ocrq.jobs.index import JobIndex
from ocrq.messages import (
    Chunk,
    Item,
    check_task,
    checked_message,
    message_bytes,
)
from ocrq.output.export import invalidate, request_export
from ocrq.output.export import results as export_results
from ocrq.output.parts import read_index
from ocrq.redact import redact_text
from ocrq.settings import LimitSettings, Settings
from ocrq.store.storage import ResultStore, make_s3_client, make_store
from producer.acked import acknowledged
from producer.errors import (
    BrokerFull,
    Conflict,
    InvalidName,
    ParamsTooLarge,
    SubmissionRefused,
    UnknownJob,
    UnsupportedTask,
    unreachable,
)
from producer.intake import IntakePlan, Uploaded, plan_intake
from producer.job import Job
from producer.name_filter import NameFilter

__all__ = ["BrokerFull", "Client", "SubmissionRefused", "UnknownJob"]

#: progress(phase, done, total) of a submission: "submitting" (refs recorded, written and fed)
Progress = Callable[[str, int, int], None]
#: skipped files listed in the job's meta (all are counted)
_SKIPPED_IN_META = 100
#: how long a submission that stopped writing keeps its job from finishing (refreshed per window)
_SUBMITTING_TTL_S = 600


class Client:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.redis = redis_conn.client(settings.redis)
        self.index = JobIndex(self.redis, settings.redis.job_ttl)
        self._app: Any = None
        self._s3: Any = None
        self._store: ResultStore | None = None
        self._feed: Feed | None = None

    @property
    def app(self) -> Any:
        if self._app is None:
            self._app = make_celery(self.settings)
        return self._app

    @property
    def s3(self) -> Any:
        if self._s3 is None:
            self._s3 = make_s3_client(self.settings.store)
        return self._s3

    @property
    def store(self) -> ResultStore:
        if self._store is None:
            store = self.settings.store
            if store.kind == "local" and "path" not in store.model_fields_set:
                # no local store path of our own (the relative default would resolve against this
                # directory): read where the live workers write, when they agree on one
                paths = {s["store"] for s in self.worker_states() if str(s.get("store", "")).startswith("/")}
                if len(paths) == 1:
                    store = store.model_copy(update={"path": Path(paths.pop())})
            self._store = make_store(store, self.s3 if store.kind == "s3" else None)
        return self._store

    def worker_states(self) -> list[dict[str, Any]]:
        """The states live workers publish each second (ocrq.keys.worker_state)."""
        found = list(self.redis.scan_iter(keys.worker_state("*"), count=200))
        states = []
        for raw in self.redis.mget(found) if found else []:
            try:
                state = json.loads(raw) if raw else None
            except ValueError:
                continue
            if isinstance(state, dict):
                states.append(state)
        return states

    def worker_roots(self) -> list[Path]:
        """The allowed roots live workers report (empty when none is running)."""
        roots = {str(root): None for state in self.worker_states() for root in state.get("allowed_roots") or []}
        return [Path(r) for r in roots]

    def engine_capabilities(self, queue: str | None = None) -> list[dict[str, Any]]:
        """What the engines of the live workers consuming ``queue`` honour (ocrq.capabilities)."""
        queue = queue or self.settings.queue.name
        return [s["capabilities"] for s in self.worker_states()
                if isinstance(s.get("capabilities"), dict) and queue in (s.get("queues") or [])]

    def check_supported(self, task: str, params: dict[str, Any] | None = None, queue: str | None = None) -> None:
        """``UnsupportedTask`` (naming the engines that can) when no live worker of ``queue`` can
        honour ``task`` with ``params``. With none live there is no one to ask: a worker that
        gets it later fails the images typed."""
        why = refusal(task, params, self.engine_capabilities(queue))
        if why is not None:
            raise UnsupportedTask(why)

    def check_reachable(self, timeout: float = redis_conn.PROBE_TIMEOUT_S) -> None:
        """``Unreachable`` unless Redis answers within ``timeout`` seconds (one try): a command
        line says so at once instead of reconnecting for half a minute."""
        try:
            redis_conn.probe(self.settings.redis, timeout)
        except (redis.RedisError, OSError) as exc:  # refused, timed out, a password wanted, not a Redis
            raise unreachable(self.settings.redis.url, exc) from exc

    def plan(self, refs: Iterable[str], limits: LimitSettings | None = None,
             uploaded: Uploaded | None = None, match: NameFilter = NameFilter()) -> IntakePlan:
        """Expand and check the refs without publishing anything (``IntakePlan.summary()``).

        The producer's roots are ``limits.allowed_roots``; when those are not set, the roots the
        live workers report, else the current directory. Local refs must also lie inside a live
        worker's roots, so the producer never publishes what every worker would refuse.
        ``limits``: other rules than the settings' (a tenant's, through the API); ``uploaded``: a
        manifest the caller sent (``producer.intake.Uploaded``); ``match``: which files found in
        folders and prefixes to take (``producer.name_filter``)."""
        limits = limits if limits is not None else self.settings.limits
        workers = self.worker_roots()
        if not limits.allowed_roots and workers:
            limits = limits.model_copy(update={"allowed_roots": workers})
        return plan_intake(refs, limits, s3_client=self.s3, worker_roots=workers, uploaded=uploaded, match=match)

    def submit(self, refs: Iterable[str] | IntakePlan, *, job: str, task: str = "text",
               params: dict[str, Any] | None = None, priority: int | None = None,
               queue: str | None = None, parquet: bool = False, republish: bool = False,
               progress: Progress | None = None, openai_batch: bool = False,
               meta: dict[str, Any] | None = None) -> Job:
        """Submit every accepted ref as job ``job``: recorded, written to the store, and fed to
        the workers ``queue.window`` images at a time (ocrq.jobs.feed). Refs (or a ``plan`` of them)
        with any refused entry raise ``SubmissionRefused`` and publish nothing. ``parquet``: the
        job's export at completion also has a Parquet file (ocrq.output.export); ``openai_batch``: and OpenAI
        Batch output and error files (ocrq.output.openai_responses). The same submission
        again resumes it (a producer killed mid-way); ``republish`` then also sends again what no
        worker finished (after Redis lost data). ``progress(phase, done, total)`` follows it.
        ``meta``: more of the job's meta (what the API keeps: its webhook, metadata)."""
        if not names.qualified_ok(job):
            raise InvalidName(f"job name {names.shown(job)}: use letters, digits, '.', '_', '-' (≤ 128), "
                              "starting with a letter or digit")
        try:
            check_task(task)
        except ValueError as exc:
            raise UnsupportedTask(str(exc)) from None
        params = params or {}
        self.check_supported(task, params, queue)
        params_size = message_bytes(params)
        if params_size > self.settings.queue.max_message_bytes // 4:
            raise ParamsTooLarge(f"task params of {params_size} bytes exceed a quarter of queue.max_message_bytes"
                           f" ({self.settings.queue.max_message_bytes}): pass large inputs by reference")
        if self.index.cancelled_at(job) is not None:
            raise Conflict(f"job {job} was cancelled: `ocrq reprocess --job {job}` runs what it did not, "
                           "or submit under another name")
        plan = refs if isinstance(refs, IntakePlan) else self.plan(refs)
        try:
            if plan.refused:
                raise SubmissionRefused(plan)
            exports = ["jsonl"] + ["parquet"] * parquet + ["openai-batch"] * openai_batch
            return self._publish(plan, job, task, params, priority, queue or self.settings.queue.name,
                                 exports, republish, progress, meta or {})
        finally:
            plan.close()

    def _publish(self, plan: IntakePlan, job: str, task: str, params: dict[str, Any], priority: int | None,
                 queue: str, exports: list[str], republish: bool = False, progress: Progress | None = None,
                 meta: dict[str, Any] | None = None) -> Job:
        self.check_room()
        try:
            # on Sentinel: returns once the replicas hold it, written again after a failover
            return acknowledged(lambda: self._record_and_publish(plan, job, task, params, priority, queue, exports,
                                                                 republish, progress, meta or {}),
                                self.redis, job, self.settings.redis)
        except redis.exceptions.OutOfMemoryError as exc:  # reached maxmemory meanwhile: run it again later
            raise BrokerFull(self.settings.redis.url, *self._memory()) from exc

    def _memory(self) -> tuple[int, int]:
        """The broker Redis's (used_memory, maxmemory) in bytes (maxmemory 0: no limit)."""
        info = self.redis.info("memory")
        return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))

    def check_room(self) -> None:
        """``BrokerFull`` when the broker's Redis holds ``redis.refuse_submit_at`` of its
        ``maxmemory`` or more: new work waits, so the running jobs can finish (Redis refuses
        writes at its limit, and the broker would stop with them)."""
        used, limit = self._memory()
        if limit and used >= self.settings.redis.refuse_submit_at * limit:
            raise BrokerFull(self.settings.redis.url, used, limit)

    def _record_and_publish(self, plan: IntakePlan, job: str, task: str, params: dict[str, Any],
                            priority: int | None, queue: str, exports: list[str], republish: bool,
                            progress: Progress | None, meta: dict[str, Any]) -> Job:
        feed = self.feed
        # an archived job (finished and exported) keeps no records in Redis: its final images are
        # the result documents in the store, and a re-submission leaves them alone
        archived = self.index.exists(job) and self.index.archived(job)
        final = self._final_ids(job, plan, task, params) if archived else set()
        if final is None or (final and all(keys.image_id(job, ref, row) in final for ref, row in plan.entries())):
            self.request_export(job, queue)
            return Job(self, job, published=0, plan=plan)  # nothing new: nothing registered
        windows = -(-plan.accepted // WINDOW)
        sub, new = feed.register(job, submission_id(task, params, plan.lines()), windows, task, params, queue,
                                 priority)
        if not new and sub.written >= sub.windows:
            # the same submission again, all of it written: the fleet feeds itself. Republish is
            # the recovery after Redis lost data: what no worker finished goes out again
            sent = feed.republish(job, sub) if republish else 0
            feed.top_up(job)
            self.request_export(job, queue)
            return Job(self, job, published=sent, plan=plan, resumed=True)
        self._check_sizes(plan, job)
        skipped = [redact_text(f"{e.value}: {e.reason}") for e in plan.skipped_sample[:_SKIPPED_IN_META]]
        # queue and priority are kept so `ocrq reprocess` re-publishes where the job ran
        self.index.create(job, {"task": task, "params": params, "queue": queue, "priority": priority,
                                "exports": exports,
                                "skipped": plan.skipped, "skipped_sample": skipped, **meta})
        first = sub.written
        added = self._write_windows(plan, job, sub, final, progress)
        feed.top_up(job)
        self.index.add_requests(job, max(0, sub.windows - first), 0)  # the shards written now
        # nothing left to run (no accepted file, or all already final): export now
        self.request_export(job, queue)
        return Job(self, job, published=added, plan=plan, resumed=not new)

    def _write_windows(self, plan: IntakePlan, job: str, sub: Submission, final: set[str],
                       progress: Progress | None) -> int:
        """Window by window: record the refs (a marker each), write the shard of those this
        submission added, and feed; workers start on the first window while the rest is written.
        The job cannot finish meanwhile (keys.job_submitting): never an export of half of it.
        Returns how many images the submission added."""
        feed = self.feed
        guard = keys.job_submitting(job)
        self.redis.set(guard, sub.sub, ex=_SUBMITTING_TTL_S)
        mine = markers.queued(sub.ordinal)
        added = 0
        for n, window in enumerate(read_entries(plan.items())):
            if n < sub.written:  # a resumed submit: this shard is written (its refs recorded)
                continue
            if self.index.cancelled_at(job) is not None:  # cancelled meanwhile: the rest is not submitted
                break
            lines = [(keys.image_id(job, ref, row), ref, row, spec) for ref, row, spec in window]
            new_here = sum(self.index.record_queued(job, [line[0] for line in lines if line[0] not in final],
                                                    sub.ordinal))
            if new_here and not added:  # new work: the job's export (if any) no longer describes it
                invalidate(self.redis, self.store, job)
            added += new_here
            values = self.index.raw(job, [line[0] for line in lines])
            self.store.put_many([(keys.refs_shard(job, sub.sub, n),
                                  shard_bytes(line for line, v in zip(lines, values, strict=True) if v == mine))])
            feed.written(job, sub, n + 1)
            feed.top_up(job)
            self.redis.expire(guard, _SUBMITTING_TTL_S)
            if progress:
                progress("submitting", min((n + 1) * WINDOW, plan.accepted), plan.accepted)
        # (a producer killed mid-way leaves the guard to expire: the same command again resumes)
        self.redis.delete(guard)
        return added

    def _check_sizes(self, plan: IntakePlan, job: str) -> None:
        """``TooLarge`` before anything is recorded, for a ref whose message alone would exceed
        ``queue.max_message_bytes`` (a manifest row too large to carry)."""
        cap = self.settings.queue.max_message_bytes
        for ref, row, spec in plan.items():
            if not row and not spec:
                continue  # refs alone are capped at refs.MAX_REF_CHARS: a chunk of them fits
            item = Item(id=keys.image_id(job, ref, row), ref=ref, row=row, **(spec or {}))
            checked_message(Chunk(job=job, items=[item]), cap)

    @property
    def feed(self) -> Feed:
        if self._feed is None:
            q = self.settings.queue
            self._feed = Feed(self.redis, self.store, self.index, self.app, window=q.window, chunk_size=q.chunk_size,
                              max_message_bytes=q.max_message_bytes)
        return self._feed

    def request_export(self, job: str, queue: str | None = None, force: bool = False) -> bool:
        """Publish the job's export if it is finished and not exported yet (``force``: again)."""
        if force:
            self.redis.delete(keys.job_finishing(job))

        # on the job's own queue (kept in its meta), where its workers listen
        queue = queue or self.index.meta(job).get("queue") or self.settings.queue.name

        def send(task_id: str) -> None:
            publish.finish(self.app, job, task_id, queue)

        return request_export(self.redis, self.index, job, send, self.settings.redis.job_ttl)

    def _final_ids(self, job: str, plan: IntakePlan, task: str, params: dict[str, Any]) -> set[str] | None:
        """The final images of the archived ``job`` (its documents); None when ``plan`` is a
        submission the job had (its results index names it): every image of it is final."""
        prior = read_index(self.store, job)
        if prior is not None and submission_id(task, params, plan.lines()) in prior.get("submissions", []):
            return None
        return {r.record.id for r in export_results(self.index, self.store, job) if r.record.status.final}

    def reprocess_failed(self, job: str | None = None, *, error: str | None = None,
                         dry_run: bool = False) -> int:
        """Re-publish failed images (optionally one error type) with a fresh attempt budget, on
        each job's own queue and priority, and a named job's cancelled images
        (``producer.reprocess``); returns how many (would be, with ``dry_run``)."""
        from producer.reprocess import reprocess

        return reprocess(self, job, error=error, dry_run=dry_run)

    def cancel(self, job: str) -> dict[str, int]:
        """Cancel ``job``: its images not yet started never run, running ones finish and are
        kept, and the job ends ``cancelled`` with its export of what finished
        (``producer.reprocess``). Returns its counts."""
        from producer.reprocess import cancel

        return cancel(self, job)

    def job(self, name: str) -> Job:
        """A handle on an existing job (``UnknownJob`` if there is none by that name)."""
        if not self.index.exists(name):
            raise UnknownJob(name)
        return Job(self, name)

    def close(self) -> None:
        self.redis.close()
