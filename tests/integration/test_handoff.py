"""The broker hand-off (ocrq.broker.transport): a consumer killed at the first moment its process holds a
message, before kombu has recorded it unacked, loses nothing; the reaper brings the message back.
Kombu's stock Redis transport pops with BRPOP and records afterwards, so the same kill left the
message in no list and no unacked entry (the chaos suite's `all` scenario lost chunks so).
Real redis-server, real consumer processes on ocrq's Celery app."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
from kombu import Consumer, Exchange, Producer, Queue

from ocrq import keys
from ocrq.broker.queue import make_celery
from ocrq.broker.transport import Channel
from ocrq.settings import Settings
from worker.reaper import Reaper, kombu_route

pytestmark = pytest.mark.integration

QUEUE = "handoff"

# A consumer on ocrq's Celery app. With DIE set it SIGKILLs itself when kombu's QoS.append is
# called: the message has reached Python (popped from its list), not yet recorded by kombu.
_CONSUMER = textwrap.dedent("""
    import json, os, signal, sys
    from kombu import Consumer, Exchange, Queue
    from kombu.transport import redis as kredis
    from ocrq.broker.queue import make_celery
    from ocrq.settings import Settings

    url, die, name = sys.argv[1], sys.argv[2] == "die", sys.argv[3]
    if die:
        def append(self, message, tag):
            os.kill(os.getpid(), signal.SIGKILL)
        kredis.QoS.append = append
        try:  # ocrq's QoS records deliveries itself
            import ocrq.broker.transport
            ocrq.broker.transport.QoS.append = append
        except ImportError:
            pass
    app = make_celery(Settings(redis={"url": url}))
    got = []
    with app.connection_for_read() as conn:
        queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
        with Consumer(conn, [queue], callbacks=[lambda body, msg: (got.append(body), msg.ack())],
                      accept=["json"]):
            deadline = __import__("time").monotonic() + 20
            while not got and __import__("time").monotonic() < deadline:
                try:
                    conn.drain_events(timeout=1)
                except TimeoutError:
                    pass
    print(json.dumps(got))
""")


def _consume(redis_url: str, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CONSUMER, redis_url, mode, QUEUE], capture_output=True,
                          text=True, timeout=60)


def _publish(app, body: dict, priority: int = 0) -> None:
    queue = Queue(QUEUE, Exchange(QUEUE, type="direct"), routing_key=QUEUE)
    with app.connection_for_write() as conn:
        Producer(conn).publish(body, exchange=queue.exchange, routing_key=QUEUE, declare=[queue],
                               serializer="json", priority=priority)


def _queued(redis_client) -> int:
    return sum(redis_client.llen(k) for k in redis_client.keys(f"{QUEUE}*"))


def test_transport_is_ocrqs_and_rings(redis_url, redis_client):
    app = make_celery(Settings(redis={"url": redis_url}))
    with app.connection_for_write() as conn:
        assert isinstance(conn.default_channel, Channel)
    _publish(app, {"n": 0})
    assert _queued(redis_client) == 1 and redis_client.llen(keys.queue_ring(QUEUE)) == 1


def test_a_consumer_killed_holding_an_unrecorded_message_loses_nothing(redis_url, redis_client):
    app = make_celery(Settings(redis={"url": redis_url}))
    _publish(app, {"n": 1})
    assert _queued(redis_client) == 1
    died = _consume(redis_url, "die")
    assert died.returncode == -9, died.stderr[-2000:]
    # popped from its list; with the atomic claim it is recorded unacked (stock kombu: nowhere)
    assert _queued(redis_client) == 0
    assert redis_client.hlen(keys.CELERY_UNACKED) == 1, "the message is in no list and not unacked: lost"
    entry = json.loads(redis_client.hvals(keys.CELERY_UNACKED)[0])
    assert entry[1:] == [QUEUE, QUEUE]
    # nobody claims it: the reaper puts it back (no waiting, for the test), a consumer gets it
    with app.connection_for_write() as conn:
        reaper = Reaper(redis_client, kombu_route(conn.default_channel), dead_after=0, confirm=0)
        assert reaper.sweep() == [] and len(reaper.sweep()) == 1
    assert redis_client.hlen(keys.CELERY_UNACKED) == 0 and _queued(redis_client) == 1
    ok = _consume(redis_url, "keep")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout) == [{"n": 1}]
    assert redis_client.hlen(keys.CELERY_UNACKED) == 0 and _queued(redis_client) == 0


def test_a_message_published_without_a_wakeup_token_is_still_consumed(redis_url, redis_client):
    """Kombu's own restore and the reaper push messages without a token: claimed at the next
    BRPOP timeout (1 s)."""
    app = make_celery(Settings(redis={"url": redis_url}))
    _publish(app, {"n": 2})
    redis_client.delete(keys.queue_ring(QUEUE))
    t0 = time.monotonic()
    ok = _consume(redis_url, "keep")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout) == [{"n": 2}]
    assert time.monotonic() - t0 < 15
    assert redis_client.hlen(keys.CELERY_UNACKED) == 0 and _queued(redis_client) == 0


def test_a_late_ack_of_a_redelivered_message_keeps_the_new_holders_record(redis_url, redis_client):
    """Kombu's delivery tag names the message, not the delivery. A first holder that acks after
    the message was redelivered (the reaper, a restore at reconnect) used to delete the second
    holder's unacked record: a retry countdown the second holder kept in memory was then in no
    list and no record, gone with that worker."""
    app = make_celery(Settings(redis={"url": redis_url}))
    _publish(app, {"n": 3})
    with app.connection_for_write() as first, app.connection_for_write() as second:
        old = first.default_channel.basic_get(QUEUE)
        assert old is not None and redis_client.hlen(keys.CELERY_UNACKED) == 1
        # the first holder looks dead to the reaper: the message goes back and is taken again
        reaper = Reaper(redis_client, kombu_route(first.default_channel), dead_after=0, confirm=0)
        reaper.sweep()
        assert reaper.sweep() == [old.delivery_tag]
        new = second.default_channel.basic_get(QUEUE)
        assert new is not None and new.delivery_tag == old.delivery_tag
        old.ack()  # the first holder finishes late
        assert redis_client.hlen(keys.CELERY_UNACKED) == 1, "the new holder's record was erased by a stale ack"
        # the first holder's channel closing restores nothing of the new delivery (no duplicate)
        first.default_channel.close()
        assert _queued(redis_client) == 0 and redis_client.hlen(keys.CELERY_UNACKED) == 1
        new.ack()
        assert redis_client.hlen(keys.CELERY_UNACKED) == 0 and redis_client.zcard(keys.CELERY_UNACKED_INDEX) == 0


def test_a_requeue_on_a_channel_closed_by_a_lost_connection_leaves_the_message_to_the_reaper(
        redis_url, redis_client):
    """Celery requeues a chunk whose retry could not be published (``Reject(requeue=True)``) while
    Redis is down; by then the consumer may have closed the channel (``channel.connection`` is
    None). Kombu's restore then built a connection pool from nothing: AttributeError, "Unrecoverable
    error", the worker process died (chaos ``all``, CI on 2026-12-02). Now the reject returns, the
    unacked record stays, and the reaper gives the message back once no worker claims it."""
    app = make_celery(Settings(redis={"url": redis_url}))
    _publish(app, {"n": 6})
    with app.connection_for_write() as conn, app.connection_for_write() as other:
        channel = conn.default_channel
        msg = channel.basic_get(QUEUE)
        assert msg is not None and redis_client.hlen(keys.CELERY_UNACKED) == 1
        transport, pool = channel.connection, channel._pool
        channel.connection, channel._pool = None, None  # what the lost connection's teardown leaves
        try:
            msg.reject(requeue=True)
        finally:
            channel.connection, channel._pool = transport, pool
        assert redis_client.hlen(keys.CELERY_UNACKED) == 1 and _queued(redis_client) == 0
        reaper = Reaper(redis_client, kombu_route(other.default_channel), dead_after=0, confirm=0)
        reaper.sweep()
        assert reaper.sweep() == [msg.delivery_tag]
        assert _queued(redis_client) == 1 and redis_client.hlen(keys.CELERY_UNACKED) == 0


def test_no_ack_consumers_leave_no_unacked_records(redis_url, redis_client):
    """Celery's reply queues (``inspect``, results over the broker) consume without acks: what
    they take must not be recorded, or it would sit in ``unacked`` for the reaper forever."""
    app = make_celery(Settings(redis={"url": redis_url}))
    _publish(app, {"n": 4})
    _publish(app, {"n": 5})
    queue = Queue(QUEUE, Exchange(QUEUE, type="direct"), routing_key=QUEUE)
    got: list[dict] = []
    with app.connection_for_read() as conn:
        assert conn.default_channel.basic_get(QUEUE, no_ack=True) is not None
        with Consumer(conn, [queue], callbacks=[lambda body, msg: got.append(body)], no_ack=True,
                      accept=["json"]):
            conn.drain_events(timeout=10)
    assert len(got) == 1
    assert redis_client.hlen(keys.CELERY_UNACKED) == 0 and _queued(redis_client) == 0


def test_the_claim_keeps_kombus_priority_order(redis_url, redis_client):
    """One list per priority level (0 most urgent, as Celery on Redis orders them); within a
    level, first in first out."""
    app = make_celery(Settings(redis={"url": redis_url}))
    for n, priority in ((1, 9), (2, 0), (3, 5), (4, 0)):
        _publish(app, {"n": n}, priority)
    with app.connection_for_read() as conn:
        got = [conn.default_channel.basic_get(QUEUE) for _ in range(4)]
        assert [m.decode()["n"] for m in got] == [2, 4, 3, 1]
        assert redis_client.hlen(keys.CELERY_UNACKED) == 4
        for m in got:
            m.ack()
    assert redis_client.hlen(keys.CELERY_UNACKED) == 0 and _queued(redis_client) == 0
