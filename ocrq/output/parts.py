"""A job's result documents in the store, and reading them back.

A worker writes the final images of a stored chunk as one part (``keys.result_part``: JSON lines,
one ImageResult each), then records each image's marker with the part's number (``ocrq.jobs.index``):
one PUT per chunk, not one per image. A part is written once and never replaced: its name is new
(``JobIndex.new_part``), and it is only created (``ResultStore.put_many``'s ``new``), since a
failover or a crash can set the Redis counter back and hand a number out twice; the writer then
takes the next one. An image done again (a reprocess, a redelivered chunk whose first
attempt stored its part but not its records) gets a line in a newer part and its marker names
that one, so a part may hold lines that are no longer current.

Reading a job:

- with records in Redis (running, or finished and not yet archived): walked in submission order
  (its refs shards, ``ocrq.jobs.feed``), each image's marker naming its part;
- its export writes the results index (``keys.results_index``): the parts that walk took lines
  from, in order, with the positions of the lines it did not take. An archived job is read
  through it, without Redis;
- archived, then given new work (a reprocess, another submission): walked as above, then
  through its index, where an image with a record in Redis again is taken from Redis;
- images with a record that no shard names (a chunk published by something other than ``ocrq
  submit``) are found by a scan of the job's records at the end, when the walk met fewer
  records than Redis holds.

Documents written before parts (one object per image, ``keys.result_object``) read the same way:
a marker without a number names that object, and so does an index entry.
"""

from __future__ import annotations

import hashlib
import json
import time
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

from ocrq import keys, markers
from ocrq.errors import MissingObject
from ocrq.jobs.feed import Line, Spec, Submission, shard_specs, submissions
from ocrq.jobs.index import JobIndex, finished
from ocrq.output import gcpause
from ocrq.redact import redact_url
from ocrq.results import ImageRecord, ImageResult, ImageStatus
from ocrq.store.storage import ResultStore

_LOAD_BATCH = 512
#: parts kept parsed while walking: a chunk's images are consecutive in a submission
_KEEP_PARTS = 64


@dataclass
class Located:
    result: ImageResult
    #: its document: (path, line in it); None when it has none (queued, running, lost)
    where: tuple[str, int] | None = None
    #: read through an image's record in Redis (not an index alone)
    from_redis: bool = True


class Parts:
    """Part files (and per-image documents of before) read through a small cache of parsed ones.
    ``sizes``: the number of lines of every part read."""

    def __init__(self, store: ResultStore, keep: int = _KEEP_PARTS) -> None:
        self.store = store
        self.keep = keep
        self.sizes: dict[str, int] = {}
        self._parsed: OrderedDict[str, dict[str, tuple[int, ImageResult]]] = OrderedDict()

    def load(self, paths: Iterable[str]) -> None:
        wanted = [p for p in dict.fromkeys(paths) if p not in self._parsed]
        if not wanted:
            return
        # the store read runs with the collector on: S3 GETs may take seconds, other threads go on
        raw = self.store.get_many(wanted, raw=True)
        with gcpause.paused():
            for path in wanted:
                data = raw.get(path)
                if data is None:
                    continue  # counted written and gone: its images read as their markers say
                lines = [ImageResult.model_validate_json(ln) for ln in data.splitlines() if ln.strip()]
                self.sizes[path] = len(lines)
                self._parsed[path] = {r.record.id: (n, r) for n, r in enumerate(lines)}
                # never evict what this call loads: a batch of small chunks' images spans more
                # parts than ``keep`` (512 images of 4-image chunks: 128 parts)
                while len(self._parsed) > max(self.keep, len(wanted)):
                    self._parsed.popitem(last=False)

    def find(self, path: str, image_id: str) -> tuple[int, ImageResult] | None:
        return self._parsed.get(path, {}).get(image_id)

    def lines(self, path: str) -> list[tuple[int, ImageResult]]:
        return sorted(self._parsed.get(path, {}).values(), key=lambda pair: pair[0])


def part_of(job: str, epoch: str | None, image_id: str, value: bytes | None) -> str | None:
    """The path of the document a final marker names (b"d12": part 12; b"d": the per-image
    object of before); None for other markers."""
    if not markers.is_final(value):
        return None
    part = markers.part_number(value)
    if part is None or epoch is None:
        return keys.result_object(job, image_id)
    return keys.result_part(job, epoch, part)


def document(index: JobIndex, store: ResultStore, job: str, image_id: str, path: str | None = None
             ) -> ImageResult | None:
    """One image's stored document: in ``path`` (a part named elsewhere: the failed mirror names
    its image's) or the part its marker names; None when it has none."""
    if path is None:  # (no marker either: a document as written before parts, if any)
        path = (part_of(job, _epoch(index, job), image_id, (index.raw(job, [image_id]) or [None])[0])
                or keys.result_object(job, image_id))
    parts = Parts(store)
    parts.load([path])
    found = parts.find(path, image_id)
    return None if found is None else found[1]


def results(index: JobIndex, store: ResultStore, job: str, batch: int = _LOAD_BATCH,
            skip: Callable[[str], bool] | None = None) -> Iterator[ImageResult]:
    """Every image of the job, once: a final one with its document, one a worker is on as its
    record, a queued one as a record made from its shard line (see the module's docstring).
    ``skip(image id)``: images left out before their documents are read (a reader following a
    job reads only the parts of images it has not had yet)."""
    for found in located(index, store, job, batch, skip=skip):
        yield found.result


def located(index: JobIndex, store: ResultStore, job: str, batch: int = _LOAD_BATCH,
            parts: Parts | None = None, skip: Callable[[str], bool] | None = None) -> Iterator[Located]:
    parts = parts if parts is not None else Parts(store)
    if index.archived(job):
        yield from _archived(parts, job, _Seen(), batch, skip)
        return
    # a finished job may be archived while it is read (its markers and shards go): what was
    # read is remembered (8 bytes an image), and the rest comes through the index then
    counts = index.counts(job)
    seen = _Seen() if finished(counts) else None
    try:
        for found in _walk(index, parts, job, batch, seen is not None, skip):
            if seen is not None:
                seen.add(found.result.record.id)
            yield found
    except _ArchivedMeanwhile:
        assert seen is not None
        yield from _archived(parts, job, seen, batch, skip)


class _ArchivedMeanwhile(Exception):
    pass


class _Seen:
    """Image ids as 64-bit digests (8 bytes each: a million ids collide with odds of ~1 in
    10^7), sorted once when first asked."""

    def __init__(self) -> None:
        self._ids = array("Q")
        self._sorted: array[int] | None = None

    @staticmethod
    def _digest(image_id: str) -> int:
        return int.from_bytes(hashlib.blake2b(image_id.encode(), digest_size=8).digest(), "big")

    def add(self, image_id: str) -> None:
        self._ids.append(self._digest(image_id))

    def __contains__(self, image_id: str) -> bool:
        if self._sorted is None:
            self._sorted = array("Q", sorted(self._ids))
        key = self._digest(image_id)
        at = bisect_left(self._sorted, key)
        return at < len(self._sorted) and self._sorted[at] == key


def _archived(parts: Parts, job: str, seen: _Seen, batch: int,
              skip: Callable[[str], bool] | None = None) -> Iterator[Located]:
    prior = read_index(parts.store, job)
    left_out = seen.__contains__ if skip is None else (lambda i: i in seen or skip(i))
    yield from (_through_index(None, parts, job, None, prior, left_out, batch) if prior is not None
                else _per_image_objects(parts.store, job, batch))


def _walk(index: JobIndex, parts: Parts, job: str, batch: int, finished: bool,
          skip: Callable[[str], bool] | None = None) -> Iterator[Located]:
    """A job with records in Redis: its shards, then its last index (if it was archived before),
    then the records no shard names. ``finished``: a missing marker or shard may mean the job
    was archived meanwhile (``_ArchivedMeanwhile``). ``skip``: images left out (``results``)."""
    prior = read_index(parts.store, job)
    epoch = _epoch(index, job)
    in_redis = int(index.redis.hlen(keys.job_images(job)))
    subs = submissions(index.redis, job)
    if finished and not subs and index.archived(job):
        raise _ArchivedMeanwhile
    # with an index, what the walk took from Redis (in flight: bounded) is skipped there
    taken: set[str] | None = set() if prior is not None else None
    seen = 0
    for pairs in _shard_batches(parts.store, job, subs, batch, (lambda: index.archived(job)) if finished else None):
        if taken is not None:
            taken.update(i for (i, _, _), _ in pairs)
        seen += len(pairs)
        if skip is not None:
            pairs = [pair for pair in pairs if not skip(pair[0][0])]
        values = index.raw(job, [i for (i, _, _), _ in pairs])
        if finished and None in values and index.archived(job):
            raise _ArchivedMeanwhile
        yield from _by_marker(parts, job, epoch, pairs, values)
    if prior is not None and taken is not None:
        left_out = taken.__contains__ if skip is None else (lambda i: i in taken or skip(i))
        for found in _through_index(index, parts, job, epoch, prior, left_out, batch):
            if found.from_redis:
                seen += 1
                taken.add(found.result.record.id)  # (a later scan for records no shard names skips it)
            yield found
    if seen < in_redis:  # records no shard names (a chunk published by something else)
        if taken is None:
            taken = {i for part in _shard_batches(parts.store, job, subs, batch) for (i, _, _), _ in part}
        yield from _unsharded(index, parts, job, epoch, taken, batch, skip)


def _shard_batches(store: ResultStore, job: str, subs: list[Submission], batch: int,
                   archived: Callable[[], bool] | None = None) -> Iterator[list[tuple[Line, Spec]]]:
    for sub in subs:
        for window in range(sub.written):
            try:
                lines = shard_specs(store, job, sub, window)
            except MissingObject:
                if archived is not None and archived():  # (its shards go with the archive)
                    raise _ArchivedMeanwhile from None
                raise
            for start in range(0, len(lines), batch):
                yield lines[start:start + batch]


def _epoch(index: JobIndex, job: str) -> str | None:
    raw = index.redis.hget(keys.job(job), "epoch")
    return None if raw is None else str(json.loads(raw))


def _by_marker(parts: Parts, job: str, epoch: str | None, lines: list[tuple[Line, Spec]],
               values: list[bytes | None]) -> list[Located]:
    paths = [part_of(job, epoch, i, v) for ((i, _, _), _), v in zip(lines, values, strict=True)]
    parts.load(p for p in paths if p is not None)
    out: list[Located] = []
    with gcpause.paused():
        for ((image_id, ref, row), spec), value, path in zip(lines, values, paths, strict=True):
            out.append(_resolve(parts, job, image_id, ref, row, value, path, spec))
    return out


def _resolve(parts: Parts, job: str, image_id: str, ref: str, row: dict[str, Any] | None,
             value: bytes | None, path: str | None, spec: Spec = None) -> Located:
    found = parts.find(path, image_id) if path is not None else None
    if found is not None and path is not None:
        return Located(found[1], (path, found[0]))
    if markers.is_record(value):
        return Located(ImageResult(record=ImageRecord.model_validate_json(value)))
    # queued, or final without its document (lost from the store): what the marker and shard say
    status = markers.status(value) or ImageStatus.queued
    return Located(ImageResult(record=ImageRecord(id=image_id, job=job, ref=redact_url(ref), status=status,
                                                  row=row), spec=spec))


def _through_index(index: JobIndex | None, parts: Parts, job: str, epoch: str | None, prior: dict[str, Any],
                   skip: Callable[[str], bool], batch: int) -> Iterator[Located]:
    """The documents the job's last export listed, but those ``skip`` names; with ``index``, an
    image with a record in Redis again (reprocessed since) is taken from there."""
    entries = iter(prior.get("parts", []))
    while group := list(islice(entries, max(1, batch // 64))):
        paths = [keys.results_prefix(job) + name for name, _ in group]
        parts.load(paths)
        current = [(path, n, doc) for path, skips in zip(paths, (set(s) for _, s in group), strict=True)
                   for n, doc in parts.lines(path) if n not in skips and not skip(doc.record.id)]
        if index is None:
            yield from (Located(doc, (path, n), from_redis=False) for path, n, doc in current)
            continue
        values = index.raw(job, [doc.record.id for _, _, doc in current])
        again = [part_of(job, epoch, doc.record.id, v) for (_, _, doc), v in zip(current, values, strict=True)]
        parts.load(p for p in again if p is not None)
        for (path, n, doc), value, now in zip(current, values, again, strict=True):
            if value is None:
                yield Located(doc, (path, n), from_redis=False)
            else:
                rec = doc.record
                yield _resolve(parts, job, rec.id, rec.ref, rec.row, value, now)


def _unsharded(index: JobIndex, parts: Parts, job: str, epoch: str | None, taken: set[str],
               batch: int, skip: Callable[[str], bool] | None = None) -> Iterator[Located]:
    """Images a worker recorded that no shard names (a message from elsewhere), by a scan of the
    job's records (a scan may return an image twice: each is yielded once)."""
    for key, value in index.redis.hscan_iter(keys.job_images(job), count=batch):
        image_id = key.decode()
        if image_id in taken:
            continue
        taken.add(image_id)
        if skip is not None and skip(image_id):
            continue
        path = part_of(job, epoch, image_id, value)
        if path is not None:
            parts.load([path])
        ref = ""
        if markers.is_record(value):
            ref = ImageRecord.model_validate_json(value).ref
        yield _resolve(parts, job, image_id, ref, None, value, path)


def _per_image_objects(store: ResultStore, job: str, batch: int) -> Iterator[Located]:
    """An archived job exported before result parts: its per-image documents, as listed."""
    prefix = keys.results_prefix(job)
    paths = (p for p in store.list(prefix) if "/" not in p[len(prefix):] and p.endswith(".json")
             and p != keys.results_index(job))
    while group := list(islice(paths, batch)):
        docs = store.get_many(group, raw=True)
        with gcpause.paused():
            parsed = [Located(ImageResult.model_validate_json(docs[p]), (p, 0)) for p in group if p in docs]
        yield from parsed


# --- the results index -----------------------------------------------------------------------

class IndexWriter:
    """What a walk took from which part, written as the job's results index once it is done."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._taken: dict[str, set[int]] = {}

    def add(self, found: Located) -> None:
        if found.where is not None:
            path, n = found.where
            self._taken.setdefault(path, set()).add(n)

    def document(self, parts: Parts, subs: Iterable[Submission] = ()) -> dict[str, Any]:
        """The index: per part read, the positions not taken; and the submissions the job had
        (a re-submission of one of them to the archived job adds nothing)."""
        prefix = keys.results_prefix(self.job)
        entries = [[path[len(prefix):], sorted(set(range(parts.sizes.get(path, 0))) - taken)]
                   for path, taken in self._taken.items()]
        return {"job": self.job, "parts": entries, "submissions": [s.sub for s in subs], "written": time.time()}


def read_index(store: ResultStore, job: str) -> dict[str, Any] | None:
    doc = store.get_json(keys.results_index(job))
    return doc if isinstance(doc, dict) else None
