"""What ops do: watch the fleet in Flower (a real Flower process) and reprocess failed images."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ocrq.jobs.failed import registered
from producer.client import Client
from tests.conftest import free_port
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration


def test_reprocess_failed_after_fixing_the_input(redis_url, start_worker, tmp_path):
    # Given a job where one file was not yet readable at first (a half-written upload)
    src = tmp_path / "in"
    truth = word_images(src, 2)
    late = src / "late.png"
    late.write_bytes(b"\x89PNG\r\n\x1a\n")
    refs = [str(p) for p in truth] + [str(late)]
    start_worker(worker_env(redis_url, tmp_path / "store", [tmp_path]))
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))
    job = client.submit(refs, job="fixme")
    assert job.wait(timeout=120)["failed"] == 1
    # (the finished job is archived once exported: its registry is then the store's mirror)
    assert [f.record.ref for f in registered(client.index, client.store, "fixme")] == [str(late)]
    # When the file appears and ops reprocess the failed registry through the CLI
    late.write_bytes(next(iter(truth)).read_bytes())
    env = {**os.environ, "OCRQ_REDIS__URL": redis_url, "OCRQ_STORE__PATH": str(tmp_path / "store"),
           "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(tmp_path)])}
    out = subprocess.run([sys.executable, "-m", "ocrq_cli", "reprocess", "--job", "fixme"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "re-published 1" in out.stderr
    # Then it is done (a cache hit: same bytes as the first image) and the registry is empty
    counts = job.wait(timeout=120)
    assert counts["done"] == 3 and counts["failed"] == 0, counts
    assert list(registered(client.index, client.store, "fixme")) == []


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def test_flower_shows_workers_tasks_and_queue(redis_url, start_worker, tmp_path):
    port = free_port()
    log = (tmp_path / "flower.log").open("wb")
    flower = subprocess.Popen(
        [sys.executable, "-m", "celery", "--broker", redis_url, "flower", f"--port={port}", "--address=127.0.0.1"],
        env={**os.environ, "FLOWER_UNAUTHENTICATED_API": "true"}, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        word_images(tmp_path / "in", 3)
        start_worker(worker_env(redis_url, tmp_path / "store", [tmp_path]), name="flw")
        client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))
        job = client.submit([str(tmp_path / "in")], job="flower")
        job.wait(timeout=120)
        deadline = time.time() + 60
        tasks: dict = {}
        workers: dict = {}
        while time.time() < deadline:
            try:
                tasks = _get(f"http://127.0.0.1:{port}/api/tasks")  # type: ignore[assignment]
                workers = _get(f"http://127.0.0.1:{port}/api/workers?refresh=1")  # type: ignore[assignment]
            except OSError:
                time.sleep(0.5)
                continue
            if any(t.get("state") == "SUCCESS" for t in tasks.values()) and workers:
                break
            time.sleep(0.5)
        assert any(name.startswith("flw@") for name in workers), workers
        assert any(t["name"] == "ocrq.ocr_chunk" and t["state"] == "SUCCESS" for t in tasks.values()), tasks
        queues = _get(f"http://127.0.0.1:{port}/api/queues/length")
        assert any(q["name"] == "ocrq" for q in queues["active_queues"]), queues  # type: ignore[index]
    finally:
        flower.terminate()
        flower.wait(10)
        print(Path(tmp_path / "flower.log").read_text()[-2000:])
