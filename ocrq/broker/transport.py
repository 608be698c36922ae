"""The Redis broker transport ocrq runs on: kombu's, with a consume step that cannot drop a message.

Kombu's Redis transport takes a message with ``BRPOP`` (the list pop is the whole hand-off) and
records it in ``unacked`` afterwards, in a second round trip from Python (``QoS.append``). From
the pop until that record the message exists only in a socket buffer or in the worker's memory;
a ``kill -9`` of the worker, a Redis restart or a dropped connection in between loses it for
good: no list, no ``unacked`` entry, nothing for ``visibility_timeout`` or ocrq's reaper to bring
back (kombu#305, celery#7950; kombu#1733 closed only the channel-close case). Kombu 5.7 widened the
window: a ``BRPOP`` reply that arrives when the prefetch window is full (ocrq narrows it once a
second, worker.prefetch) is parked unread until credit returns, and a disconnect discards it.
The chaos suite's combined scenario lost whole chunks that way (docs/reliability.md).

Here the pop and the record are one Lua script (``claim``): it pops the first message of the
consumer's lists, in kombu's priority order, and writes the ``unacked`` entry and index exactly
as ``QoS.append`` would, atomically. The QoS's append then rewrites the entry (harmless).
Blocking moves to a per-queue wake-up list (``keys.queue_ring``): publishers push a token there
beside each message, consumers ``BRPOP`` it with kombu's timeout and then claim. A token is only
a hint: a lost or parked token (the old hazard) costs nothing, and a message published without
one (kombu's own restore, ocrq's reaper, another client) is claimed at the next timeout (1 s).
After a successful claim the next wait is near zero, so a backlog drains at full speed.

Records are delivery-scoped (``QoS``): kombu's delivery tag names the message, not the
delivery, so once a message was redelivered (the reaper, a restore at reconnect) the first
holder's late ack deleted the second holder's record, and a retry countdown the second holder
kept in memory was then in no list and no record. Each delivery remembers the index score it
wrote; its ack, reject or restore touches the record only while that score is still there.

Also: after Celery 5.7 loses the broker connection it closes the old connection twice (collect,
then close); the second close restores the channel's unacked messages through a transport whose
client is already gone and the worker dies with ``AttributeError: 'NoneType' … 'hostname'``
(an "Unrecoverable error"). ``QoS.restore_unacked`` here leaves those messages in ``unacked``
when the transport is gone: they are the reaper's to bring back (worker.reaper), and the worker
reconnects instead of exiting.

``ocrq.broker.queue.make_celery`` calls ``ocrq.broker.transport_aliases.install()``: the ``redis`` and ``rediss``
transport aliases then name this class, so broker URLs keep their scheme (Flower picks its broker reader from it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

from kombu.transport import redis as kredis
from kombu.transport import virtual
from kombu.transport.virtual import Empty
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from ocrq import keys
from ocrq.broker import scripts
from ocrq.broker.scripts import PastMaxmemory

log = logging.getLogger("ocrq.transport")

#: the wait after a successful claim: a backlog is drained without blocking between messages
CLAIM_AGAIN_S = 0.01


#: tokens kept per queue (a bound only: past it, claims after a success drain the rest)
RING_CAP = 10_000


class Captured(NamedTuple):
    """A message published inside ``captured()``: the list kombu would push it to, the queue's
    wake-up list, and the message as kombu serialises it."""

    list_key: str
    ring_key: str
    payload: str


_CAPTURED: ContextVar[list[Captured] | None] = ContextVar("ocrq_captured", default=None)


@contextmanager
def captured() -> Iterator[list[Captured]]:
    """Messages published in this block, in this thread, are collected instead of pushed, so one
    Lua script can push them together with the state that says they were sent (ocrq.jobs.feed: a
    shard's chunks and its feed cursor, atomically). Publish with a producer on this transport."""
    sink: list[Captured] = []
    token = _CAPTURED.set(sink)
    try:
        yield sink
    finally:
        _CAPTURED.reset(token)


class QoS(kredis.QoS):
    """Kombu's Redis QoS with delivery-scoped records: each delivery remembers the index score it
    wrote, and its ack, reject or restore touches the record only while that score is still there.
    Kombu's delivery tag names the message, not the delivery, so after a redelivery (the reaper,
    a restore at reconnect) a stale ack from the first holder used to delete the record of the
    second, leaving a message it held in memory (a retry countdown) in no list at all."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scores: dict[str, float] = {}

    def append(self, message: Any, delivery_tag: str) -> None:
        claimed = self.channel._claimed_at.pop(delivery_tag, None)
        if claimed is not None:  # the claim script recorded it already, with this score
            self._scores[delivery_tag] = claimed
            virtual.QoS.append(self, message, delivery_tag)
            return
        delivery = message.delivery_info
        now = kredis.time()
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: now}) \
                .hset(self.unacked_key, delivery_tag,
                      dumps([message._raw, delivery["exchange"], delivery["routing_key"]])) \
                .execute()
        self._scores[delivery_tag] = now
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        self._forget(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            self.restore_by_tag(delivery_tag, leftmost=True)
        else:
            self._forget(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def _forget(self, delivery_tag: str) -> None:
        score = self._scores.pop(delivery_tag, None)
        if self._transport_gone():
            log.warning("broker connection gone: the unacked record of %s stays for the reaper", delivery_tag)
            return
        with self.channel.conn_or_acquire() as client:
            if score is None:  # not delivered through this QoS: kombu's unconditional removal
                self._remove_from_indices(delivery_tag, client.pipeline()).execute()
            else:
                client.eval(scripts.source("transport_ack"), 2, self.unacked_key, self.unacked_index_key,
                            delivery_tag, repr(score))

    def restore_by_tag(self, tag: str, client: Any = None, leftmost: bool = False) -> None:
        score = self._scores.pop(tag, None)
        if client is None and self._transport_gone():
            # a requeue (Celery's Reject(requeue=True): our retry publish failed) on a channel
            # closed under us by the lost connection: kombu would build a pool from nothing and
            # the worker died ("Unrecoverable error", chaos `all`). The unacked record stays; no
            # held set claims it once this QoS forgets it, so the dead-worker reaper restores it
            log.warning("broker connection gone: %s stays unacked for the dead-worker reaper", tag)
            return

        def restore_transaction(pipe: Any) -> None:
            if score is not None and pipe.zscore(self.unacked_index_key, tag) != score:
                pipe.multi()  # redelivered since: the record (if any) is another holder's
                return
            p = pipe.hget(self.unacked_key, tag)
            pipe.multi()
            self._remove_from_indices(tag, pipe)
            if p:
                m, ex, rk = loads(bytes_to_str(p))
                self.channel._do_restore_message(m, ex, rk, pipe, leftmost)

        with self.channel.conn_or_acquire(client) as conn:
            conn.transaction(restore_transaction, self.unacked_key, self.unacked_index_key)

    def restore_unacked(self, client: Any = None) -> None:
        if self._transport_gone():
            # the transport was closed under us (Celery's collect-then-close after a lost
            # connection): kombu would crash the worker building a client from nothing
            if self._delivered:
                log.warning("broker connection gone: leaving %d unacked message(s) to the dead-worker"
                            " reaper", len(self._delivered))
            self._delivered.clear()
            self._scores.clear()
            return
        super().restore_unacked(client)

    def _transport_gone(self) -> bool:
        return getattr(self.channel.connection, "client", None) is None


class Channel(kredis.Channel):
    QoS = QoS

    _claimed_last = False
    _claim_queues: list[str] = []
    _claim_script: Any = None
    _put_script: PastMaxmemory | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: queues consumed without acks: what is taken from them is not recorded unacked
        self._no_ack_queues: set[str] = set()
        #: delivery tag -> the unacked score the claim script wrote (QoS.append then writes nothing)
        self._claimed_at: dict[str, float] = {}
        super().__init__(*args, **kwargs)
        if not self.ack_emulation or self.global_keyprefix:
            # the claim script writes kombu's unacked records under their plain names
            raise ValueError("ocrq's broker transport needs ack_emulation on and no global_keyprefix")

    # -- one client for kombu's short commands --------------------------------------------
    _sync_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """Kombu builds a new ``redis.Redis`` for every publish, claim and ack (~60 µs each: the
        client's response-callback tables, several per chunk on each side); a client is only a
        thread-safe handle on the connection pool, so one per pool serves them all (a new pool,
        after kombu dropped its connections, gets a new one)."""
        if client:
            yield client
            return
        pool = self.pool
        cached = self._sync_client
        if cached is None or cached.connection_pool is not pool:
            cached = self._sync_client = self._create_client()
        yield cached

    # -- publishing: a wake-up token beside each message ------------------------------------
    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        sink = _CAPTURED.get()
        if sink is not None:  # collected for one atomic script (ocrq.jobs.feed), not pushed here
            pri = self._get_message_priority(message, reverse=False)
            sink.append(Captured(self._q_for_pri(queue, pri), keys.queue_ring(queue), dumps(message)))
            return
        batch = kwargs.get("_publish_batch")
        ring = keys.queue_ring(queue)
        if batch is not None:
            super()._put(queue, message, **kwargs)
            batch.add("lpush", ring, 1)
            batch.add("ltrim", ring, 0, RING_CAP - 1)
            return
        # the message and its token in one script that runs past maxmemory: a retry, an export
        # or a restored message finishes accepted work (new work is refused before: ocrq.broker.scripts)
        pri = self._get_message_priority(message, reverse=False)
        with self.conn_or_acquire() as client:
            if self._put_script is None or self._put_script.client is not client:
                self._put_script = PastMaxmemory(client, "transport_put")
            self._put_script(keys=[self._q_for_pri(queue, pri), ring], args=[dumps(message), RING_CAP])

    def _size(self, queue: str) -> int:
        """The queue's length over its priority lists: plain reads, not kombu's MULTI, which Redis
        refuses past maxmemory (a queue declare before a publish, a job's export among them)."""
        with self.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            for pri in self.priority_steps:
                pipe.llen(self._q_for_pri(queue, pri))
            return sum(size for size in pipe.execute() if isinstance(size, int))

    # -- consuming: wait on the rings, then claim atomically --------------------------------
    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        if no_ack:
            self._no_ack_queues.add(queue)
        else:
            self._no_ack_queues.discard(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        claimed = self._claim([queue], record=not no_ack)
        if claimed is None:
            return None
        message = self.Message(loads(bytes_to_str(claimed[1])), channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def _brpop_start(self, timeout: float | None = None) -> None:
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        self._claim_queues = list(queues)
        wait = CLAIM_AGAIN_S if self._claimed_last else (timeout or 0)
        self._in_poll = self.client.connection
        self._brpop_sent_at = kredis.monotonic()  # type: ignore[assignment]  # kombu: None until sent
        self.client.connection.send_command("BRPOP", *[keys.queue_ring(q) for q in queues], wait)

    def _brpop_read(self, **options: Any) -> bool:
        try:
            try:
                # a token (or nil after the timeout): either way, look for work
                self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            if getattr(self, "_closing", False):
                raise Empty()  # closing: read the reply, take nothing more
            claimed = self._claim(self._claim_queues)
            self._claimed_last = claimed is not None
            if claimed is None:
                raise Empty()
            dest, item = claimed
            queue = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
            self.connection._deliver(loads(bytes_to_str(item)), queue)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]  # kombu's own reset
            flush = getattr(self, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()

    def _get(self, queue: str, timeout: Any = None) -> Any:
        claimed = self._claim([queue])
        if claimed is None:
            raise Empty()
        return loads(bytes_to_str(claimed[1]))

    def _claim(self, queues: list[str], record: bool | None = None) -> tuple[bytes, bytes] | None:
        """Take the first message of ``queues`` (kombu's priority order); record it unacked when
        ``record`` (None: unless the queue's consumer is a no-ack one)."""
        pairs = [(self._q_for_pri(q, pri), q) for pri in self.priority_steps for q in queues]
        if not pairs:
            return None
        flags = ["1" if (record if record is not None else q not in self._no_ack_queues) else "0"
                 for _, q in pairs]
        now = kredis.time()
        with self.conn_or_acquire() as client:
            if self._claim_script is None:
                self._claim_script = scripts.plain(client, "transport_claim")
            out = self._claim_script(keys=[self.unacked_key, self.unacked_index_key, *(k for k, _ in pairs)],
                                     args=[now, *flags], client=client)
        if not out:
            return None
        tag = _delivery_tag(out[1])
        if tag is not None and flags[[k for k, _ in pairs].index(bytes_to_str(out[0]))] == "1":
            self._claimed_at[tag] = now
        return out[0], out[1]


def _delivery_tag(raw: bytes) -> str | None:
    """The delivery tag of a claimed message, as the claim script read it."""
    try:
        props = loads(bytes_to_str(raw))["properties"]
        tag = props["delivery_tag"]
    except (ValueError, KeyError, TypeError):
        return None
    return tag if isinstance(tag, str) and isinstance(props.get("delivery_info"), dict) else None


class Transport(kredis.Transport):
    Channel = Channel
    # Declared, so kombu's ensure() keeps retrying a connection error after it has reconnected
    # once (without it kombu calls the transport unable to tell recoverable errors apart and
    # raises the second one): a publish right after a Sentinel promotion met "The previous
    # master is now a slave" twice, from a Sentinel that had not yet seen the promotion, and
    # `ocrq submit` failed within a second instead of riding the publish retry policy
    recoverable_connection_errors = kredis.Transport.connection_errors
