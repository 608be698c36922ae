"""Dead-worker redelivery (worker.reaper): a killed worker's unacked chunks go back to the queue
soon after its claim expires, with the production visibility_timeout (3600 s); a live worker's
never do. Real redis-server; the end-to-end test runs real `ocrq worker` processes."""

from __future__ import annotations

import os
import signal
import time

import pytest
from kombu.utils.json import dumps, loads

from ocrq import keys
from producer.client import Client
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for
from tests.integration.test_reliability import sim_env
from worker.reaper import Reaper, publish_held

pytestmark = pytest.mark.integration


def _deliver(client, tag: str, at: float) -> bytes:
    """What kombu's QoS.append writes when a worker takes a message."""
    message = {"body": tag, "headers": {}, "properties": {"priority": 0, "delivery_tag": tag,
                                                          "delivery_info": {"exchange": "ocrq"}}}
    entry = dumps([message, "ocrq", "ocrq"])
    client.zadd(keys.CELERY_UNACKED_INDEX, {tag: at})
    client.hset(keys.CELERY_UNACKED, tag, entry)
    return entry.encode()


def test_only_unclaimed_old_messages_are_restored_once(redis_client):
    now = 10_000.0
    reaper = Reaper(redis_client, lambda m, ex, rk: "q", dead_after=60, confirm=20)
    _deliver(redis_client, "live-old", now - 500)   # old, but a live worker claims it
    _deliver(redis_client, "dead-old", now - 500)   # old and unclaimed: its worker died
    _deliver(redis_client, "dead-young", now - 10)  # unclaimed but just delivered
    publish_held(redis_client, "alive@h", ["live-old"], ttl=60)
    # a first sweep only suspects; nothing moves
    assert reaper.sweep(now) == []
    assert redis_client.hkeys(keys.REAPER_SUSPECTS) == [b"dead-old"]
    # too soon for confirmation
    assert reaper.sweep(now + 5) == []
    # confirmed one interval later: exactly the dead worker's message goes back, marked redelivered
    assert reaper.sweep(now + 21) == ["dead-old"]
    pushed = [loads(m) for m in redis_client.lrange("q", 0, -1)]
    assert [m["body"] for m in pushed] == ["dead-old"] and pushed[0]["headers"]["redelivered"] is True
    assert sorted(redis_client.hkeys(keys.CELERY_UNACKED)) == [b"dead-young", b"live-old"]
    assert redis_client.zscore(keys.CELERY_UNACKED_INDEX, "dead-old") is None
    # idempotent: later sweeps restore nothing more, however often they run (by now the young
    # message's worker has claimed it, as a live worker does within a second)
    publish_held(redis_client, "alive@h", ["live-old", "dead-young"], ttl=600)
    assert reaper.sweep(now + 60) == [] and reaper.sweep(now + 200) == []
    assert redis_client.llen("q") == 1


def test_a_worker_that_reclaims_in_time_keeps_its_message(redis_client):
    now = 10_000.0
    reaper = Reaper(redis_client, lambda m, ex, rk: "q", dead_after=60, confirm=20)
    _deliver(redis_client, "t1", now - 500)
    assert reaper.sweep(now) == []  # suspected: no claim (say Redis restarted and lost it)
    publish_held(redis_client, "w@h", ["t1"], ttl=60)  # the live worker claims it again
    assert reaper.sweep(now + 30) == [] and redis_client.llen("q") == 0
    assert redis_client.hlen(keys.REAPER_SUSPECTS) == 0


def test_a_redelivered_message_is_not_restored_again(redis_client):
    now = 10_000.0
    reaper = Reaper(redis_client, lambda m, ex, rk: "q", dead_after=60, confirm=20)
    _deliver(redis_client, "t1", now - 500)
    assert reaper.sweep(now) == []
    # kombu's own sweep gave it back meanwhile and another worker took it (same tag, fresh time)
    _deliver(redis_client, "t1", now + 15)
    assert reaper.sweep(now + 25) == [] and redis_client.llen("q") == 0


def test_a_killed_workers_chunks_come_back_without_the_visibility_timeout(redis_url, redis_client,
                                                                          start_worker, tmp_path):
    # Given two workers with the production visibility timeout, a short claim TTL, and a slow
    # engine on the first (it cannot finish the job while the second one starts)
    word_images(tmp_path / "in", 16)
    fast_reaper = {"OCRQ_REDIS__DEAD_WORKER_S": "4", "OCRQ_REDIS__REAPER_INTERVAL_S": "1"}
    doomed = start_worker(sim_env(redis_url, tmp_path, sim={"image_latency_s": 2.0}, **fast_reaper),
                          name="doomed")
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]},
                                 queue={"chunk_size": 4}))
    job = client.submit([str(tmp_path / "in")], job="reaped")
    held_key = keys.held_tags(f"doomed@{os.uname().nodename}")
    deadline = time.time() + 30
    while not redis_client.smembers(held_key) and time.time() < deadline:
        time.sleep(0.1)
    assert redis_client.smembers(held_key)
    start_worker(sim_env(redis_url, tmp_path, sim={"image_latency_s": 0.1}, **fast_reaper), name="rescuer")
    # When the first dies mid-chunk
    held = redis_client.smembers(held_key)
    os.killpg(doomed.pid, signal.SIGKILL)
    doomed.wait(10)
    killed = time.monotonic()
    # what it took to its grave: claimed and still unacked when it died (a chunk it acked between
    # the snapshot and the kill is done, nothing to restore); read before the reaper can act
    # (dead_worker_s + a confirming sweep)
    lost = held & set(redis_client.hkeys(keys.CELERY_UNACKED))
    assert lost, "the worker died holding no unacked chunk: nothing to prove"
    # Then everything completes within seconds (dead_worker_s + 2 sweeps), not 3600 s
    counts = job.wait(timeout=90)
    assert counts["done"] == 16 and counts["failed"] == 0, counts
    assert time.monotonic() - killed < 40
    assert redis_client.hlen(keys.CELERY_UNACKED) == 0
    log = (tmp_path / "worker-rescuer.log").read_text()
    assert "restored" in log and all(t.decode() in log for t in lost), log[-3000:]


def test_a_message_that_cannot_be_routed_does_not_stop_the_sweep(redis_client):
    def route(message, exchange, routing_key):
        if message["body"] == "unroutable":
            raise AttributeError("'NoneType' object has no attribute 'state'")
        return "q"

    now = 10_000.0
    reaper = Reaper(redis_client, route, dead_after=60, confirm=0)
    _deliver(redis_client, "unroutable", now - 500)
    _deliver(redis_client, "dead-old", now - 500)
    reaper.sweep(now)
    assert reaper.sweep(now + 1) == ["dead-old"]
    assert redis_client.hkeys(keys.CELERY_UNACKED) == [b"unroutable"]
