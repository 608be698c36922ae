"""A submission returns only once the replicas hold it (Sentinel URLs; docs/reliability.md,
"Failover").

Redis replicates asynchronously: a master that acknowledged a write and died before its replicas
had it takes the write with it, and Sentinel promotes a replica without it. So after writing a
submission the producer asks the master to ``WAIT`` for ``redis.ack_replicas`` replicas (at most
``redis.ack_timeout_ms``), on the connection of a last write to the job (``WAIT`` counts from
the connection's own last write; replication is ordered, so the writes before it are covered),
and checks that the master it waited on is the one it wrote to (``master_replid``: a promoted
replica gets a new one). If either fails, the submission is written again: the same submission
again resumes it or finds it written (ocrq.jobs.feed), so a write that survived is not repeated.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from ocrq import keys
from ocrq.broker.redis_conn import is_sentinel, redacted
from ocrq.settings import RedisSettings
from producer.errors import NotReplicated

__all__ = ["NotReplicated", "acknowledged"]

log = logging.getLogger("ocrq.producer")

T = TypeVar("T")
#: writes of one submission before it is given up as not replicated
MAX_TRIES = 5


def replication_id(client: Any) -> str:
    """The master's replication id: it changes when a replica is promoted."""
    return str(client.info("replication").get("master_replid", ""))


def confirm(client: Any, job: str, ttl: int, replicas: int, timeout_ms: int, wrote_to: str) -> str | None:
    """None when ``replicas`` replicas hold everything written so far on the master named by
    ``wrote_to``; else why not."""
    pipe = client.pipeline(transaction=False)
    pipe.expire(keys.job(job), ttl)  # a write on this connection: WAIT counts from it
    pipe.execute_command("WAIT", replicas, timeout_ms)
    pipe.info("replication")
    _, acked, info = pipe.execute()
    now = str(info.get("master_replid", ""))
    if now != wrote_to:
        return "the master changed while the submission was written (a failover)"
    if int(acked) < replicas:
        return f"{acked} of {replicas} replica(s) acknowledged it within {timeout_ms} ms"
    return None


def acknowledged(write: Callable[[], T], client: Any, job: str, settings: RedisSettings) -> T:
    """``write()`` (a submission), repeated until the replicas hold it (Sentinel URLs with
    ``ack_replicas`` > 0; otherwise once)."""
    if not is_sentinel(settings.url) or settings.ack_replicas <= 0:
        return write()
    why = ""
    for attempt in range(1, MAX_TRIES + 1):
        before = replication_id(client)
        out = write()
        problem = confirm(client, job, settings.job_ttl, settings.ack_replicas, settings.ack_timeout_ms, before)
        if problem is None:
            return out
        why = problem
        log.warning("submission to job %s not confirmed (%s): writing it again (%d/%d)", job, why, attempt,
                    MAX_TRIES)
    raise NotReplicated(f"job {job}: the submission could not be confirmed on {settings.ack_replicas} replica(s) "
                        f"of {redacted(settings.url)} after {MAX_TRIES} writes ({why}); submit it again "
                        "(it resumes), or lower redis.ack_replicas")
