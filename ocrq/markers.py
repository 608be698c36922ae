"""The per-image marker: what the job index (``keys.job_images``) holds for an image no worker is
on, a few bytes instead of its record.

    q{n}      queued, in no message yet: submission n's shard feeds it (``ocrq.jobs.feed``)
    p         queued, in a message
    d{part}   done by the engine; its document is in result part {part} (``ocrq.output.parts``)
    c{part}   done from the cache; the same
    f{part}   failed; the same
    x         cancelled: it never ran
    {...}     no marker: the ImageRecord JSON of an image a worker is on (running, retrying)

A final marker without a part number (``d``) names the per-image document written before result
parts. The scripts that write markers spell them too (``index_record.lua``, ``index_cancel.lua``,
``feed_shard.lua`` in ``ocrq/broker/lua/``); Python reads them here.
"""

from __future__ import annotations

from typing import TypeGuard

from ocrq.results import ImageStatus

QUEUED = b"q"
PUBLISHED = b"p"
DONE = b"d"
CACHED = b"c"
FAILED = b"f"
CANCELLED = b"x"
#: the first byte of a record (JSON), not a marker
RECORD = b"{"

#: what each marker says (by its first byte)
STATUS: dict[bytes, ImageStatus] = {
    DONE: ImageStatus.done, CACHED: ImageStatus.done, FAILED: ImageStatus.failed,
    PUBLISHED: ImageStatus.queued, QUEUED: ImageStatus.queued, CANCELLED: ImageStatus.cancelled,
}
_FINAL = (DONE, CACHED, FAILED)


def queued(submission: int) -> bytes:
    """The marker of an image submission ``submission`` recorded and has not fed yet."""
    return QUEUED + str(submission).encode()


def is_record(value: bytes | None) -> TypeGuard[bytes]:
    """Whether ``value`` is a record (a worker is on the image), not a marker."""
    return value is not None and value[:1] == RECORD


def is_unpublished(value: bytes | None) -> TypeGuard[bytes]:
    """Queued in no message yet (its shard feeds it)."""
    return value is not None and value[:1] == QUEUED


def is_queued(value: bytes | None) -> TypeGuard[bytes]:
    """Queued, in a message or not."""
    return value is not None and value[:1] in (QUEUED, PUBLISHED)


def is_final(value: bytes | None) -> TypeGuard[bytes]:
    """Done or failed: a marker naming the image's document."""
    return value is not None and value[:1] in _FINAL


def part_number(value: bytes) -> int | None:
    """The result part a final marker names (b"d12": 12); None for one that names none (b"d":
    the per-image document of before)."""
    return int(value[1:]) if len(value) > 1 else None


def status(value: bytes | None) -> ImageStatus | None:
    """What a marker says; None for a record, an unknown value or none."""
    return STATUS.get(value[:1]) if value else None
