"""Nothing is lost: engine crashes are retried per image through Celery, a worker killed
mid-chunk gives its message back, and two workers on one queue share it (no hoarding).
Real Redis, real `ocrq worker` processes; the engine is the simulated one (named so), whose
failures are injected through settings."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from ocrq import keys
from producer.client import Client
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration


def sim_env(redis_url, tmp_path, **extra):
    extra_settings = extra.pop("sim", {})
    env = {"OCRQ_ENGINE__KIND": "simulated", "OCRQ_ENGINE__EXTRA": json.dumps(extra_settings),
           "OCRQ_BATCH__MODE": "auto", "OCRQ_QUEUE__CHUNK_SIZE": "4", **extra}
    return worker_env(redis_url, tmp_path / "store", [tmp_path], **env)


def test_engine_crash_is_retried_per_image_and_visible_as_retry(redis_url, start_worker, tmp_path):
    # Given an engine whose first batch crashes (not a memory error)
    word_images(tmp_path / "in", 8)
    start_worker(sim_env(redis_url, tmp_path, sim={"crashes": 1}))
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]},
                                 queue={"chunk_size": 4}))
    # When 8 images are submitted
    job = client.submit([str(tmp_path / "in")], job="crash")
    counts = job.wait(timeout=120)
    # Then all are done; the crashed batch's images took a second attempt
    assert counts["done"] == 8 and counts["failed"] == 0, counts
    attempts = [r.attempts for r in job.records()]
    assert set(attempts) <= {1, 2} and 2 in attempts, attempts
    # and the retry went through Celery (a RETRY of the chunk task, which Flower shows)
    assert "retry: Retry in" in (tmp_path / "worker-w1.log").read_text()
    # and each chunk's summary (what Flower's task list shows from the task events) adds up
    log = (tmp_path / "worker-w1.log").read_text()
    done = [int(n) for n in re.findall(r"Task ocrq\.ocr_chunk\[\w+\] succeeded in [\d.]+s: \{[^}]*'done': (\d+)", log)]
    assert sum(done) == 8, done


def test_transient_oom_is_absorbed_in_process(redis_url, redis_client, start_worker, tmp_path):
    # Given an engine whose first 3 batches run out of memory
    word_images(tmp_path / "in", 8)
    start_worker(sim_env(redis_url, tmp_path, sim={"transient_ooms": 3}))
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))
    job = client.submit([str(tmp_path / "in")], job="oom")
    counts = job.wait(timeout=120)
    # Then every image is done on its first attempt (the engine loop bisected in-process) ...
    assert counts["done"] == 8 and counts["failed"] == 0, counts
    assert {r.attempts for r in job.records()} == {1}
    # ... and the OOMs did happen: the worker's published state counted all three
    state_key = keys.worker_state(f"w1@{socket.gethostname()}")
    deadline = time.monotonic() + 10
    while (ooms := json.loads(redis_client.get(state_key))["oom_events"]) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ooms == 3, ooms


def test_an_image_out_of_attempts_fails_permanently_naming_the_cause(redis_url, start_worker, tmp_path):
    # Given an engine that crashes on every batch and a budget of 2 attempts
    word_images(tmp_path / "in", 3)
    start_worker(sim_env(redis_url, tmp_path, sim={"crashes": 1000}, OCRQ_QUEUE__MAX_ATTEMPTS="2"))
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))
    job = client.submit([str(tmp_path / "in")], job="exhausted")
    counts = job.wait(timeout=120)
    # Then each image is failed for good, with the truth: out of attempts, and why
    assert counts["failed"] == 3 and counts["done"] == 0, counts
    for rec in job.records():
        assert rec.attempts == 2 and rec.error is not None
        assert rec.error.type == "RetriesExhausted" and rec.error.retryable is False, rec.error
        assert rec.error.message.startswith("after 2 attempts: EngineCrashed: RuntimeError: simulated"), rec.error
    # and each has its failed result document in the store
    assert [r.record.error.type for r in job.results() if r.record.error] == ["RetriesExhausted"] * 3


def test_killed_worker_gives_its_chunk_back(redis_url, start_worker, tmp_path):
    # Given a slow engine and a short visibility timeout
    word_images(tmp_path / "in", 4)
    env = sim_env(redis_url, tmp_path, sim={"image_latency_s": 30}, OCRQ_REDIS__VISIBILITY_TIMEOUT="4",
                     OCRQ_REDIS__UNACKED_RESTORE_S="2")
    first = start_worker(env, name="doomed")
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]},
                                 redis={"visibility_timeout": 4}))
    job = client.submit([str(tmp_path / "in")], job="killed")
    deadline = time.time() + 30
    while job.status()["running"] == 0 and time.time() < deadline:
        time.sleep(0.2)
    assert job.status()["running"] > 0
    # When the worker dies mid-chunk (no chance to ack or clean up)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(10)
    # Then a fresh worker gets the same message again and finishes every image
    start_worker(sim_env(redis_url, tmp_path, OCRQ_REDIS__VISIBILITY_TIMEOUT="4",
                     OCRQ_REDIS__UNACKED_RESTORE_S="2"), name="rescuer")
    counts = job.wait(timeout=120)
    assert counts["done"] == 4 and counts["failed"] == 0, counts
    assert {r.worker for r in job.records()} == {f"rescuer@{os.uname().nodename}"}


def test_two_workers_share_one_queue(redis_url, start_worker, tmp_path):
    word_images(tmp_path / "in", 24)
    env = sim_env(redis_url, tmp_path, sim={"image_latency_s": 0.3})
    start_worker(env, name="a")
    start_worker(env, name="b")
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]},
                                 queue={"chunk_size": 4}))
    job = client.submit([str(tmp_path / "in")], job="shared")
    counts = job.wait(timeout=180)
    assert counts["done"] == 24
    by_worker: dict[str, int] = {}
    for rec in job.records():
        by_worker[rec.worker.split("@")[0]] = by_worker.get(rec.worker.split("@")[0], 0) + 1
    assert set(by_worker) == {"a", "b"}, by_worker
    assert min(by_worker.values()) >= 4, by_worker


def test_prefetch_follows_the_governor_not_the_pool_size(redis_url, redis_client, start_worker, tmp_path):
    # Given a slow worker with 4 pool threads whose governor wants batches of 2
    word_images(tmp_path / "in", 32)
    env = sim_env(redis_url, tmp_path, sim={"image_latency_s": 0.4}, OCRQ_BATCH__MODE="fixed",
                  OCRQ_BATCH__SIZE="2", TEST_CONCURRENCY="4")
    start_worker(env)
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]},
                                 queue={"chunk_size": 4}))
    # When 8 chunks are queued
    job = client.submit([str(tmp_path / "in")], job="prefetch")
    held = []
    while not job.finished():
        held.append(redis_client.hlen(keys.CELERY_UNACKED))
        time.sleep(0.2)
    # Then it never reserved more chunks than its window needs, although its pool could run 4 at
    # once: the batch in flight + the governor's backlog (2 + 2 × 2 images = 2 chunks), +1 while
    # the next is fetched
    assert max(held) <= 3, held
    state = json.loads(redis_client.get(next(redis_client.scan_iter("ocrq:workers:*"))))
    assert state["prefetch"] in (1, 2) and state["mode"] == "fixed"  # 2 while a batch is in flight


def test_a_slow_engine_times_out_the_attempt_and_the_retry_finishes(redis_url, start_worker, tmp_path):
    # Given an engine slower than the chunk's time limit
    word_images(tmp_path / "in", 2)
    start_worker(sim_env(redis_url, tmp_path, sim={"image_latency_s": 1.5}, OCRQ_QUEUE__TIME_LIMIT="1",
                         OCRQ_BATCH__MODE="fixed", OCRQ_BATCH__SIZE="2"))
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))
    job = client.submit([str(tmp_path / "in")], job="slow")
    # Then the first attempt gives up (EngineTimeout, retryable), a retry picks up the result
    counts = job.wait(timeout=120)
    assert counts["done"] == 2, counts
    assert all(r.attempts >= 2 for r in job.records())
    assert "retry=2" in (tmp_path / "worker-w1.log").read_text()


def test_a_restarted_worker_continues_from_what_its_governor_learned(redis_url, redis_client, start_worker,
                                                                     tmp_path):
    # Given a worker whose governor calibrated on a job
    word_images(tmp_path / "in", 16)
    env = sim_env(redis_url, tmp_path, sim={"noise": 0.02})
    first = start_worker(env, name="a")
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]},
                                 queue={"chunk_size": 4}))
    assert client.submit([str(tmp_path / "in")], job="learn").wait(timeout=120)["done"] == 16
    deadline = time.monotonic() + 10
    while not (found := list(redis_client.scan_iter(keys.governor_profile("*")))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(found) == 1, found
    saved = json.loads(redis_client.get(found[0]))
    learned = saved["calibration"]["observations"]
    assert learned >= 1 and saved["calibration"]["points"]
    # When it stops and a new worker with the same model and settings starts
    os.killpg(first.pid, signal.SIGTERM)
    first.wait(30)
    start_worker(env, name="b")
    # Then the new worker's governor starts from that calibration, not from the priors
    state_key = keys.worker_state(f"b@{socket.gethostname()}")
    deadline = time.monotonic() + 10
    while (raw := redis_client.get(state_key)) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    state = json.loads(raw)
    assert state["restored_observations"] == learned and state["observations"] == learned
    # and ops can list the snapshot and make the next start cold
    env = {**os.environ, "OCRQ_REDIS__URL": redis_url}
    listed = subprocess.run([sys.executable, "-m", "ocrq_cli", "governor"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    row = json.loads(listed.stdout.splitlines()[0])
    assert row["key"] == found[0].decode() and row["observations"] >= learned and row["ttl_s"] > 0
    reset = subprocess.run([sys.executable, "-m", "ocrq_cli", "governor", "--reset"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert reset.returncode == 0 and "deleted 1" in reset.stdout + reset.stderr, reset.stderr
    assert not list(redis_client.scan_iter(keys.governor_profile("*")))
