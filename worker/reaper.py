"""Dead-worker redelivery: a killed worker's unacked chunks go back to the queue within
``dead_worker_s + 2 × reaper_interval_s`` (100 s by default), not after ``visibility_timeout``.

Kombu's Redis transport keeps every delivered, unacknowledged message in the ``unacked`` hash
(delivery tag → [message, exchange, routing key]) and ``unacked_index`` zset (tag → delivery
time); it gives one back only once it is ``visibility_timeout`` old (1 h here, so a slow chunk is
never run twice). Liveness comes from the workers instead:

- every worker writes the delivery tags its channel holds (``ocrq:held:{hostname}``, a SET) each
  second, with a TTL of ``dead_worker_s``: a worker that stops refreshing it (kill -9, OOM
  killer, a lost host) loses its claim when the TTL runs out;
- every worker sweeps every ``reaper_interval_s``: a tag in ``unacked`` delivered more than
  ``dead_worker_s`` ago that no held set claims is an orphan. It becomes a suspect
  (``ocrq:reaper:suspects``, tag → first seen) and is restored only when it is still an
  unclaimed orphan on a sweep at least ``reaper_interval_s`` later, so a live worker that lost
  Redis for a while (a Redis restart expires every claim) has time to claim its tags again.

Restoring is one Lua script per sweep (atomic): for each candidate it checks again that the tag
is in ``unacked`` with the same entry, old enough, claimed by no held set, and a confirmed
suspect; then it pushes the message back where kombu's own restore would (the right end of the
queue's priority list, marked redelivered) and removes the tag from ``unacked``,
``unacked_index`` and the suspects. A second sweep, or kombu's own visibility sweep, finds the
tag gone and does nothing: restoring is idempotent, and every worker may sweep (no leader: the
script costs O(unacked), a few hundred tags at most).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from celery import bootsteps
from kombu.utils.json import dumps, loads

from ocrq import keys
from ocrq.broker.scripts import PastMaxmemory, past_maxmemory

log = logging.getLogger("ocrq.reaper")



def publish_held(client: Any, hostname: str, tags: Iterable[str], ttl: int) -> None:
    """Claim ``tags`` for this worker for ``ttl`` seconds (replaces the previous claim atomically)."""
    client.eval(past_maxmemory(client, "held_claim"), 1, keys.held_tags(hostname), ttl, *tags)


class Reaper:
    """Restores the unacked messages of dead workers. ``route(payload, exchange, routing_key)``
    names the list kombu would push the message to (``kombu_route`` builds it from a channel)."""

    def __init__(self, client: Any, route: Callable[[dict[str, Any], str, str], str], dead_after: float,
                 confirm: float) -> None:
        self.client = client
        self.route = route
        self.dead_after = dead_after
        self.confirm = confirm
        # restoring finishes accepted work: it runs past maxmemory (ocrq.broker.scripts)
        self._script = PastMaxmemory(client, "reaper_restore")

    def sweep(self, now: float | None = None) -> list[str]:
        """One sweep; returns the delivery tags put back on the queue."""
        now = time.time() if now is None else now
        tags = self.client.zrangebyscore(keys.CELERY_UNACKED_INDEX, "-inf", now - self.dead_after)
        held = sorted(self.client.scan_iter(match=keys.held_tags("*"), count=500))
        quads: list[Any] = []
        targets: dict[str, int] = {}  # the lists messages go back to, by their KEYS index (from 4)
        for tag, entry in zip(tags, self.client.hmget(keys.CELERY_UNACKED, tags) if tags else [], strict=True):
            if entry is None:
                continue
            message, exchange, routing_key = loads(entry)
            for part in (message.get("headers"), message.get("properties", {}).get("delivery_info")):
                if isinstance(part, dict):
                    part["redelivered"] = True
            try:
                target = self.route(message, exchange, routing_key)
            except Exception:  # one message kombu cannot route must not stop the sweep
                log.warning("cannot route unacked message %r (exchange %r, key %r)", tag, exchange, routing_key,
                            exc_info=True)
                continue
            quads += [tag, entry, targets.setdefault(target, 4 + len(targets)), dumps(message)]
        restored = self._script(
            keys=[keys.CELERY_UNACKED, keys.CELERY_UNACKED_INDEX, keys.REAPER_SUSPECTS, *targets, *held],
            args=[now, self.dead_after, self.confirm, len(targets), *quads])
        out = [t.decode() if isinstance(t, bytes) else str(t) for t in restored]
        if out:
            log.warning("restored %d unacked message(s) of dead workers: %s", len(out), ", ".join(out))
        return out


def kombu_route(channel: Any) -> Callable[[dict[str, Any], str, str], str]:
    """Where kombu's own restore pushes a message: its queue's list for the message's priority."""

    def route(message: dict[str, Any], exchange: str, routing_key: str) -> str:
        # a list for the anonymous exchange Celery uses, a set for a named direct one
        queue = sorted(channel._lookup(exchange, routing_key))[0]
        return str(channel._q_for_pri(queue, channel._get_message_priority(message, reverse=False)))

    return route


def channel_tags(consumer: Any) -> list[str]:
    """Delivery tags the consumer's channel holds unacked (kombu's QoS record of deliveries).
    Chunks still running on an older channel (after a lost broker connection) are not claimed:
    Celery may keep such a request listed as active forever, and a claim would pin its message;
    the reaper may redeliver it instead, and the late ack of the old copy cannot erase the new
    delivery's record (ocrq.broker.transport's delivery-scoped acks)."""
    delivered = consumer.task_consumer.channel.qos._delivered
    for _ in range(5):
        try:
            return [str(t) for t in list(delivered)]
        except RuntimeError:  # changed size during iteration (the consumer thread appended)
            continue
    return [str(t) for t in list(delivered)]


def _release_quietly(conn: Any) -> None:
    try:
        conn.release()
    except Exception:  # a broken connection is being dropped anyway
        log.debug("closing the reaper's broker connection failed", exc_info=True)


def make_reaper_step(redis_client: Callable[[], Any | None], dead_after: int,
                     interval: float) -> type[bootsteps.StartStopStep]:
    """A consumer bootstep: claim held tags every second, sweep every ``interval`` seconds.
    ``redis_client`` returns the worker's Redis client once the worker context exists."""

    class DeadWorkerReaper(bootsteps.StartStopStep):
        requires = {"celery.worker.consumer.tasks:Tasks"}

        def __init__(self, parent: Any, **kwargs: Any) -> None:
            super().__init__(parent, **kwargs)
            self.trefs: list[Any] = []
            self.hostname = getattr(parent, "hostname", None) or socket.gethostname()
            self.reaper: Reaper | None = None
            self.conn: Any = None

        def start(self, c: Any) -> None:
            self.trefs = [c.timer.call_repeatedly(1.0, self.claim, (c,), priority=10),
                          c.timer.call_repeatedly(interval, self.sweep, (c,), priority=10)]

        def stop(self, c: Any) -> None:
            for tref in self.trefs:
                tref.cancel()
            self.trefs = []
            self.stop_reaper()

        def stop_reaper(self) -> None:
            conn, self.conn, self.reaper = self.conn, None, None
            if conn is not None:
                _release_quietly(conn)

        def claim(self, c: Any) -> None:
            client = redis_client()
            if client is None or c.task_consumer is None:
                return
            try:
                publish_held(client, self.hostname, channel_tags(c), dead_after)
            except Exception:
                log.warning("could not claim held delivery tags", exc_info=True)

        def sweep(self, c: Any) -> None:
            client = redis_client()
            if client is None:
                return
            try:
                if self.reaper is None:
                    # a channel of its own: the consumer's is not ours to use from the timer
                    self.conn = c.app.connection_for_write()
                    self.reaper = Reaper(client, kombu_route(self.conn.default_channel), dead_after, interval)
                self.reaper.sweep()
            except Exception:
                log.warning("dead-worker sweep failed", exc_info=True)
                self.stop_reaper()  # a fresh connection and channel next time

    return DeadWorkerReaper
