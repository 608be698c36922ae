"""Every message ocrq publishes, one way: chunks of a job's images (the feed, reprocess), a job's
export (the producer, a worker, the export sweep) and the retries a worker hands back.

A chunk message holds at most ``queue.chunk_size`` images and ``queue.max_message_bytes``
(``ocrq.messages.chunk_groups``), carries its job's task, params and priority, and has a task id
derived from its contents (``keys.chunk_id``): the same images published again are the same
message (a suffix tells a reprocess's apart). Only task names cross over: the producer never
imports the worker.

A publish that meets a broker that will not take writes for a moment (a failover: the old master,
a Sentinel that names a replica, a new master without a replica in sync yet) is tried again with
backoff for ``redis_conn.RETRY_WINDOW_S``, as every other Redis client of ocrq is
(``_riding``). Kombu's own retries reconnect at once after such an error, and were spent in
under a second. A wrong password is not retried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn, TypeVar

import redis
from kombu.exceptions import OperationalError

from ocrq import keys
from ocrq.broker.redis_conn import RETRY_WINDOW_S, DeadlineRetry
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

log = logging.getLogger(__name__)
T = TypeVar("T")


def _transient(exc: BaseException) -> bool:
    """Kombu's error is worth trying again unless a refused login is behind it."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, redis.AuthenticationError):
            return False
        seen = seen.__cause__ or seen.__context__
    return True


def _failed(exc: BaseException) -> None:
    log.warning("! publish: the broker did not take the message (%s)", " ".join(str(exc).split()))


def _riding(send: Callable[[], T], window_s: float = RETRY_WINDOW_S) -> T:
    """``send()``, tried again with backoff while the broker refuses it for ``window_s`` seconds."""
    retry = DeadlineRetry(window_s, supported_errors=(OperationalError,))
    return retry.call_with_retry(send, _failed, is_retryable=_transient)


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
            _riding(partial(app.send_task, OCR_CHUNK_TASK, args=[message], argsrepr=chunk_argsrepr(message),
                            task_id=keys.chunk_id(job, part[0].id, len(part)) + id_suffix, queue=queue,
                            priority=priority, producer=producer))
            sent += 1
    return sent


def finish(app: Any, job: str, task_id: str, queue: str, *, declare: bool = True) -> None:
    """``job``'s export task on ``queue``. ``declare`` False: a queue the fleet consumes, declared
    already (a worker's publish): no declare first, whose SADD and MULTI Redis refuses past
    maxmemory, while the publish itself runs past it (ocrq.broker.transport)."""
    options: dict[str, Any] = {} if declare else {"declare": []}
    _riding(partial(app.send_task, FINISH_JOB_TASK, args=[job], task_id=task_id, queue=queue, **options))


def retry_chunk(task: Any, chunk: Chunk, items: Sequence[Item], countdown: float,
                outage_since: float | None) -> NoReturn:
    """``chunk``'s ``items`` alone, published again as ``task``'s retry after ``countdown``
    seconds (Celery's retry, which raises ``Retry``: the message in hand is then acked)."""
    message = chunk.model_copy(update={"items": list(items), "outage_since": outage_since}).to_message()
    raise task.retry(args=(message,), countdown=countdown, argsrepr=chunk_argsrepr(message))


def retry_finish(task: Any, job: str, outage_since: float, countdown: float) -> NoReturn:
    """``job``'s export task again after ``countdown`` seconds (Celery's retry: raises ``Retry``)."""
    raise task.retry(args=(job,), kwargs={"outage_since": outage_since}, countdown=countdown)
