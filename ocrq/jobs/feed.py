"""Submissions fed to the queue in windows: a submission's refs live in the store, Redis holds at
most ``queue.window`` of a job's images in messages.

A submission (one ``ocrq submit``) is identified by its content (task, params and accepted refs,
in order): running the same command again finds it. The producer, window by window (``WINDOW``
refs):

1. records the images it adds as queued (one Lua call; ``JobIndex.record`` mode ``submit``: a
   marker per image, "q{ordinal}", no ref);
2. writes the refs it added as a shard to the store (``keys.refs_shard``), counting it written in
   ``ocrq:job:{job}:feed``;
3. feeds (workers start on the first window while the rest is written). Until the last window is
   written the job cannot finish (``keys.job_submitting``).

Feeding a shard publishes its images' chunks and moves its cursor in one Lua script (the chunk
messages are built by Celery and captured, ``ocrq.broker.transport.captured``): a shard is published
once, whoever feeds it. Every worker feeds: after each chunk, and every few seconds for each job
in ``keys.FEEDING`` (``worker.feeder``), while the job has fewer than ``queue.window`` images in
flight (in a message, or a worker on them).

A producer killed mid-way leaves a registered submission: the same command again records what
is missing, writes the shards not written yet and feeds on, with no image published twice.
After Redis lost data (a crash with its last second of AOF), ``republish`` sends again what no
worker has finished (a duplicate costs a cache hit, never a second result).

Per image, Redis holds the marker (~90 bytes with the hash entry) until the job is archived;
the refs are in the store.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from ocrq import keys, markers
from ocrq.broker import publish
from ocrq.broker.scripts import PastMaxmemory
from ocrq.broker.transport import captured
from ocrq.errors import MissingObject
from ocrq.jobs.index import JobIndex
from ocrq.messages import (
    Item,
)
from ocrq.store.storage import ResultStore

log = logging.getLogger("ocrq.feed")

T = TypeVar("T")

#: refs per shard: what one feed step publishes, and what one record call covers
WINDOW = 4096

Line = tuple[str, str, dict[str, Any] | None]  # image id, ref, manifest row
#: an image's own task and params ({"task", "params"}: an OpenAI Batch line's), or None (the
#: submission's); a shard line carries it as a fourth element when set
Spec = dict[str, Any] | None


@dataclass
class Submission:
    sub: str
    ordinal: int
    #: shards (windows of ``WINDOW`` accepted refs)
    windows: int
    task: str
    params: dict[str, Any]
    queue: str
    priority: int | None
    #: shards written / fed so far
    written: int = 0
    fed: int = 0

    def meta(self) -> str:
        return json.dumps({"ordinal": self.ordinal, "windows": self.windows, "task": self.task,
                           "params": self.params, "queue": self.queue, "priority": self.priority})


def submissions(redis: Any, job: str) -> list[Submission]:
    """The job's submissions, in the order they were registered."""
    raw = {k.decode(): v.decode() for k, v in redis.hgetall(keys.job_feed(job)).items()}
    subs = []
    for field, value in raw.items():
        if field.startswith("sub:"):
            m = json.loads(value)
            subs.append(Submission(field[4:], m["ordinal"], m["windows"], m["task"], m["params"], m["queue"],
                                   m["priority"], int(raw.get(f"{m['ordinal']}:written", 0)),
                                   int(raw.get(f"{m['ordinal']}:fed", 0))))
    return sorted(subs, key=lambda s: s.ordinal)


def shard_lines(store: ResultStore, job: str, sub: Submission, window: int) -> list[Line]:
    """Shard ``window`` of ``sub``: (image id, ref, row) per image it added. A shard counted as
    written and not in the store is ``MissingObject`` (never an empty shard: its images would
    never be sent)."""
    return [line for line, _ in shard_specs(store, job, sub, window)]


def shard_specs(store: ResultStore, job: str, sub: Submission, window: int) -> list[tuple[Line, Spec]]:
    """``shard_lines`` with each image's own task and params (None: the submission's)."""
    path = keys.refs_shard(job, sub.sub, window)
    data = store.get_many([path], raw=True).get(path)
    if data is None:
        raise MissingObject(f"{store.location}{path}: a written shard of job {job} is not in the store")
    out: list[tuple[Line, Spec]] = []
    for raw in data.splitlines():
        if raw:
            i, ref, row, *spec = json.loads(raw)
            out.append(((i, ref, row), spec[0] if spec else None))
    return out


def submission_id(task: str, params: dict[str, Any], lines: Iterable[str]) -> str:
    """A submission's identity: its task, params and accepted refs in order."""
    digest = hashlib.sha256(json.dumps([task, params], sort_keys=True).encode())
    for line in lines:
        digest.update(line.encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def shard_bytes(lines: Iterable[Line | tuple[str, str, dict[str, Any] | None, Spec]]) -> bytes:
    """Shard lines: [image id, ref, row], and the image's spec when it has one."""
    return b"".join(json.dumps(list(line) if len(line) == 3 or line[3] is not None else list(line[:3]),
                               ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
                    for line in lines)


class Feed:
    """Submissions of jobs and their feeding. ``app``: the Celery app chunks are sent with."""

    def __init__(self, redis: Any, store: ResultStore, index: JobIndex, app: Any, *, window: int,
                 chunk_size: int, max_message_bytes: int) -> None:
        self.redis = redis
        self.store = store
        self.index = index
        self.app = app
        self.window = window
        self.chunk_size = chunk_size
        self.max_message_bytes = max_message_bytes
        # feeding finishes accepted work: it runs past maxmemory (ocrq.broker.scripts)
        self._feed = PastMaxmemory(redis, "feed_shard")

    # --- submissions ---------------------------------------------------------------------------

    def submissions(self, job: str) -> list[Submission]:
        return submissions(self.redis, job)

    def register(self, job: str, sub: str, windows: int, task: str, params: dict[str, Any], queue: str,
                 priority: int | None) -> tuple[Submission, bool]:
        """The submission ``sub`` of ``job``, registered now if it is new (then True)."""
        key = keys.job_feed(job)
        for found in self.submissions(job):
            if found.sub == sub:
                return found, False
        ordinal = int(self.redis.hincrby(key, "ordinal", 1))
        made = Submission(sub, ordinal, windows, task, params, queue, priority)
        if not self.redis.hsetnx(key, f"sub:{sub}", made.meta()):  # another producer, same content
            return next(s for s in self.submissions(job) if s.sub == sub), False
        self.redis.expire(key, self.index.ttl)
        return made, True

    def written(self, job: str, sub: Submission, shards: int) -> None:
        """``shards`` of ``sub`` are in the store: workers may feed them."""
        pipe = self.redis.pipeline()
        pipe.hset(keys.job_feed(job), f"{sub.ordinal}:written", shards)
        pipe.sadd(keys.FEEDING, job)
        pipe.execute()
        sub.written = shards

    def lines(self, job: str, sub: Submission, window: int) -> list[Line]:
        return shard_lines(self.store, job, sub, window)

    # --- feeding -------------------------------------------------------------------------------

    def top_up(self, job: str) -> int:
        """Feed the job's next shards while its images in flight stay within the window; returns
        how many images were published. A job with nothing left to feed leaves ``FEEDING``."""
        published = 0
        left = False
        subs = self.submissions(job)
        # a cancelled job's shards publish nothing (the feed script cancels what they hold): no window
        room = (lambda: True) if self.index.cancelled_at(job) is not None else (
            lambda: self.index.window(job) + WINDOW <= self.window)
        for sub in subs:
            while sub.fed < sub.written and room():
                n = self.feed_shard(job, sub, sub.fed)
                published += max(n, 0)
                sub.fed += 1
                if n < 0:  # another feeder took it: re-read where the cursors are
                    return published + self.top_up(job)
            left = left or sub.fed < sub.windows
        if not left:  # (a job whose keys expired has none: it leaves too)
            self.redis.srem(keys.FEEDING, job)
        return published

    def feed_shard(self, job: str, sub: Submission, window: int, only: Callable[[bytes | None], bool] | None = None,
                   cursor: bool = True) -> int:
        """Publish shard ``window`` of ``sub``: the images still queued and unpublished (or what
        ``only`` accepts of their Redis values), as chunk messages, with the cursor moved in the
        same script (``cursor`` False: no cursor, for ``republish``)."""
        lines = shard_specs(self.store, job, sub, window)
        values = self.index.raw(job, [i for (i, _, _), _ in lines])
        want = only or markers.is_unpublished
        todo = [Item(id=i, ref=ref, row=row, **(spec or {}))
                for ((i, ref, row), spec), v in zip(lines, values, strict=True) if want(v)]
        with captured() as sink:
            publish.chunks(self.app, job, todo, task=sub.task, params=sub.params, queue=sub.queue,
                           priority=sub.priority, chunk_size=self.chunk_size, max_message_bytes=self.max_message_bytes)
        field = f"{sub.ordinal}:fed" if cursor else f"{sub.ordinal}:republished"
        args: list[Any] = [field, window if cursor else self._republished(job, field), sub.windows, job, len(todo),
                           *(it.id for it in todo)]
        lists: dict[str, int] = {}  # the message lists and wake-up lists, by their KEYS index (from 6)
        for msg in sink:
            args += [lists.setdefault(msg.list_key, 6 + len(lists)), lists.setdefault(msg.ring_key, 6 + len(lists)),
                     msg.payload]
        n = int(self._feed(keys=[keys.job_feed(job), keys.job_images(job), keys.job_counts(job), keys.FEEDING,
                                 keys.job(job), *lists], args=args))
        if n >= 0:
            log.debug("fed job=%s submission=%s shard=%d: %d image(s) in %d chunk(s)", job, sub.sub, window,
                     len(todo), len(sink))
        return n if n < 0 else len(todo)

    def _republished(self, job: str, field: str) -> int:
        return int(self.redis.hget(keys.job_feed(job), field) or 0)

    def republish(self, job: str, sub: Submission) -> int:
        """Send again every image of ``sub`` that is queued (published or not): the recovery after
        Redis lost data. Returns how many images were sent."""
        sent = 0
        for window in range(sub.written):
            sent += max(self.feed_shard(job, sub, window, only=markers.is_queued,
                                        cursor=False), 0)
        return sent


def read_entries(entries: Iterator[T], size: int = WINDOW) -> Iterator[list[T]]:
    """The accepted entries ((ref, row) pairs, or (ref, row, spec)) in windows of ``size``."""
    window: list[T] = []
    for entry in entries:
        window.append(entry)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window
