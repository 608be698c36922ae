"""A small urgent job submitted behind a large bulk job the worker is already working through
finishes long before the bulk job: its chunk is delivered ahead of the bulk chunks still queued
(kombu's priority lists), and the engine loop takes its images ahead of the bulk images the
worker already holds. Real Redis, a real `ocrq worker`; the engine is the simulated one (named so),
0.2 s a batch of 8."""

from __future__ import annotations

import time

import pytest

from producer.client import Client
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for
from tests.integration.test_reliability import sim_env

pytestmark = pytest.mark.integration


def test_an_urgent_job_overtakes_a_bulk_job_already_running(redis_url, start_worker, tmp_path):
    word_images(tmp_path / "bulk", 240)
    word_images(tmp_path / "urgent", 8, seed=1)
    start_worker(sim_env(redis_url, tmp_path, sim={"batch_latency_s": 0.2}, OCRQ_BATCH__MODE="fixed",
                         OCRQ_BATCH__SIZE="8", OCRQ_QUEUE__CHUNK_SIZE="8"))
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]},
                                 queue={"chunk_size": 8}))
    # Given a bulk job of 240 images (30 batches: ~6 s of engine time) the worker has started on
    bulk = client.submit([str(tmp_path / "bulk")], job="bulk", priority=9)
    deadline = time.monotonic() + 60
    while bulk.status()["done"] < 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    # When an urgent job of 8 images arrives
    t0 = time.monotonic()
    urgent = client.submit([str(tmp_path / "urgent")], job="urgent", priority=0)
    counts = urgent.wait(timeout=60, poll=0.05)
    took = time.monotonic() - t0
    left = bulk.status()
    # Then it is done within a few batches, while most of the bulk job is still to do
    print(f"\nurgent job: {took:.2f} s; bulk done then: {left['done']}/240")
    assert counts["done"] == 8, counts
    assert left["done"] < 160, (left, took)
    assert took < 3.0, (left, took)
    assert bulk.wait(timeout=120)["done"] == 240
