"""Every message ocrq publishes, one way: chunks of a job's images (the feed, reprocess), a job's
export (the producer, a worker, the export sweep) and the retries a worker hands back.

A chunk message holds at most ``queue.chunk_size`` images and ``queue.max_message_bytes``
(``ocrq.messages.chunk_groups``), carries its job's task, params and priority, and has a task id
derived from its contents (``keys.chunk_id``): the same images published again are the same
message (a suffix tells a reprocess's apart). Only task names cross over: the producer never
imports the worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from ocrq import keys
from ocrq.messages import (
    FINISH_JOB_TASK,
    OCR_CHUNK_TASK,
    Chunk,
    Item,
    checked_message,
    chunk_argsrepr,
    chunk_groups,
    message_bytes,
)


def chunks(app: Any, job: str, items: list[Item], *, task: str, params: dict[str, Any], queue: str,
           priority: int | None, chunk_size: int, max_message_bytes: int, id_suffix: str = "") -> int:
    """``items`` as chunk messages of ``job`` on ``queue``; returns how many messages. Inside
    ``ocrq.broker.transport.captured()`` they are collected for one script, not pushed."""
    envelope = message_bytes(Chunk(job=job, task=task, params=params, items=[]).to_message())
    sent = 0
    with app.producer_or_acquire() as producer:
        for part in chunk_groups(items, chunk_size, max_message_bytes, overhead=envelope + 64):
            message = checked_message(Chunk(job=job, task=task, params=params, items=part, priority=priority or 0),
                                      max_message_bytes)
            app.send_task(OCR_CHUNK_TASK, args=[message], argsrepr=chunk_argsrepr(message),
                          task_id=keys.chunk_id(job, part[0].id, len(part)) + id_suffix, queue=queue,
                          priority=priority, producer=producer)
            sent += 1
    return sent


def finish(app: Any, job: str, task_id: str, queue: str, *, declare: bool = True) -> None:
    """``job``'s export task on ``queue``. ``declare`` False: a queue the fleet consumes, declared
    already (a worker's publish): no declare first, whose SADD and MULTI Redis refuses past
    maxmemory, while the publish itself runs past it (ocrq.broker.transport)."""
    app.send_task(FINISH_JOB_TASK, args=[job], task_id=task_id, queue=queue, **({} if declare else {"declare": []}))


def retry_chunk(task: Any, chunk: Chunk, items: Sequence[Item], countdown: float,
                outage_since: float | None) -> NoReturn:
    """``chunk``'s ``items`` alone, published again as ``task``'s retry after ``countdown``
    seconds (Celery's retry, which raises ``Retry``: the message in hand is then acked)."""
    message = chunk.model_copy(update={"items": list(items), "outage_since": outage_since}).to_message()
    raise task.retry(args=(message,), countdown=countdown, argsrepr=chunk_argsrepr(message))


def retry_finish(task: Any, job: str, outage_since: float, countdown: float) -> NoReturn:
    """``job``'s export task again after ``countdown`` seconds (Celery's retry: raises ``Retry``)."""
    raise task.retry(args=(job,), kwargs={"outage_since": outage_since}, countdown=countdown)
