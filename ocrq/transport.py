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

``ocrq.queue.make_celery`` calls ``install()``: the ``redis`` and ``rediss`` transport aliases then
name this class, so broker URLs keep their scheme (Flower picks its broker reader from it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kombu.transport import redis as kredis
from kombu.transport import virtual
from kombu.transport.virtual import Empty
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from ocrq import keys

log = logging.getLogger("ocrq.transport")

#: the wait after a successful claim: a backlog is drained without blocking between messages
CLAIM_AGAIN_S = 0.01

# KEYS: unacked, unacked_index, then the lists to take from in priority order; ARGV: now, then per
# list '1' to record (a consumer that acks) or '0' (a no-ack consumer: Celery's reply queues).
# Pops the first message and records it in unacked as kombu's QoS.append does
# (entry = [message, exchange, routing_key]), in one atomic step. Returns {list, message} or nil.
# The message is decoded before anything is written (a script error does not roll back writes):
# one kombu could not parse either is popped and returned unrecorded, as kombu's pop would.
_CLAIM_LUA = """
for i = 3, #KEYS do
  local raw = redis.call('LINDEX', KEYS[i], -1)
  if raw then
    local ok, m = pcall(cjson.decode, raw)
    redis.call('RPOP', KEYS[i])
    if ARGV[i - 1] == '1' and ok and type(m) == 'table' and type(m['properties']) == 'table' then
      local props = m['properties']
      local tag = props['delivery_tag']
      local info = props['delivery_info']
      if type(tag) == 'string' and type(info) == 'table' then
        local ex, rk = info['exchange'], info['routing_key']
        if type(ex) ~= 'string' then ex = '' end
        if type(rk) ~= 'string' then rk = '' end
        redis.call('ZADD', KEYS[2], ARGV[1], tag)
        redis.call('HSET', KEYS[1], tag, '[' .. raw .. ', ' .. cjson.encode(ex) .. ', ' .. cjson.encode(rk) .. ']')
      end
    end
    return {KEYS[i], raw}
  end
end
return false
"""

#: tokens kept per queue (a bound only: past it, claims after a success drain the rest)
RING_CAP = 10_000


# KEYS: unacked, unacked_index; ARGV: tag, the delivery's index score. Removes the record only
# while it is still this delivery's: a message redelivered meanwhile (same tag: kombu's tags are
# per message) belongs to its new holder, whose record a late ack of the old copy must not erase.
_ACK_LUA = """
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


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
                client.eval(_ACK_LUA, 2, self.unacked_key, self.unacked_index_key, delivery_tag, repr(score))

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: queues consumed without acks: what is taken from them is not recorded unacked
        self._no_ack_queues: set[str] = set()
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
        batch = kwargs.get("_publish_batch")
        super()._put(queue, message, **kwargs)
        ring = keys.queue_ring(queue)
        if batch is not None:
            batch.add("lpush", ring, 1)
            batch.add("ltrim", ring, 0, RING_CAP - 1)
            return
        with self.conn_or_acquire() as client, client.pipeline(transaction=False) as pipe:
            pipe.lpush(ring, 1).ltrim(ring, 0, RING_CAP - 1).execute()

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
        with self.conn_or_acquire() as client:
            if self._claim_script is None:
                self._claim_script = client.register_script(_CLAIM_LUA)
            out = self._claim_script(keys=[self.unacked_key, self.unacked_index_key, *(k for k, _ in pairs)],
                                     args=[kredis.time(), *flags], client=client)
        if not out:
            return None
        return out[0], out[1]


class Transport(kredis.Transport):
    Channel = Channel


#: the kombu minor versions whose Redis channel internals (``_in_poll``, ``_brpop_sent_at``,
#: the BRPOP start/read pair) this transport was written and tested against
KOMBU_TESTED = ((5, 7),)


def install() -> None:
    """Make ``redis://`` and ``rediss://`` connections in this process use ocrq's transport."""
    import kombu
    import kombu.transport as kt

    version = tuple(int(p) for p in kombu.__version__.split(".")[:2])
    if version not in KOMBU_TESTED:
        raise RuntimeError(f"ocrq's broker transport overrides kombu's Redis channel internals and is tested "
                           f"with kombu {KOMBU_TESTED}, not {kombu.__version__}: install kombu>=5.7,<5.8")

    for scheme in ("redis", "rediss"):
        if kt.TRANSPORT_ALIASES.get(scheme) != f"{__name__}:Transport":
            kt.TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
            kt._transport_cache.pop(scheme, None)
