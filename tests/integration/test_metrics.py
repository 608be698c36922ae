"""The Prometheus exporter (a real `ocrq metrics` process) against a real Redis and worker."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from producer.client import Client
from tests.conftest import free_port
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env, worker_start_state

pytestmark = pytest.mark.integration


def _scrape(port: int) -> dict[str, float]:
    deadline = time.time() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_queue_depth_jobs_and_worker_state(redis_url, redis_client, start_worker, tmp_path):
    port = free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "ocrq_cli", "metrics", "--port", str(port)],
                                env={**os.environ, "OCRQ_REDIS__URL": redis_url}, stderr=subprocess.DEVNULL)
    try:
        # Given 3 chunks queued and no worker yet: the queue depth says so
        word_images(tmp_path / "in", 9)
        client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]},
                                     queue={"chunk_size": 3}))
        job = client.submit([str(tmp_path / "in")], job="metered", priority=5)
        before = _scrape(port)
        assert before['ocrq_queue_depth{queue="ocrq"}'] == 3
        assert before['ocrq_job_images{job="metered",status="queued"}'] == 9
        # When a worker drains it
        start_worker(worker_env(redis_url, tmp_path / "store", [tmp_path]), name="m")
        job.wait(timeout=120)
        after = _scrape(port)
        # Then the queue is empty, the job's images are done and the worker's state is exported
        assert after['ocrq_queue_depth{queue="ocrq"}'] == 0
        assert after['ocrq_job_images{job="metered",status="done"}'] == 9
        assert any(k.startswith("ocrq_worker{") and 'worker="m@' in k and 'field="prefetch"' in k for k in after)
        # and where its start went, phase by phase (worker.startup), in its state in Redis
        start = worker_start_state(redis_client, "m")
        assert list(start["phases"]) == ["interpreter", "celery", "engine", "governor", "services", "gc", "consumer"]
        assert 0 < start["ready_s"] < 120
        assert abs(sum(start["phases"].values()) - start["ready_s"]) < 0.01
    finally:
        exporter.terminate()
        exporter.wait(10)
