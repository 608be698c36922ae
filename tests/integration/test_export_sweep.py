"""A job that is final always gets its export: the sweep (worker.export_sweep) against a real Redis
asks again for what no request covers, and a real worker writes the export and archives the job
with the broker's Redis held over its maxmemory past the job's last image."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ocrq import keys
from ocrq.jobs.index import JobIndex
from ocrq.results import ImageRecord, ImageStatus
from producer.client import Client
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env
from worker.export_sweep import ExportSweep

pytestmark = pytest.mark.integration


def _job(index: JobIndex, job: str, done: int, of: int) -> None:
    index.create(job, {"task": "text", "queue": "q-" + job})
    index.record([ImageRecord(id=f"{job}{i}", job=job, ref=f"/r{i}", status=ImageStatus.queued) for i in range(of)],
                 mode="submit")
    index.record([ImageRecord(id=f"{job}{i}", job=job, ref=f"/r{i}", status=ImageStatus.done) for i in range(done)])


def test_the_sweep_asks_for_the_export_no_request_covers(redis_client: Any) -> None:
    index = JobIndex(redis_client, ttl=3600)
    sent: list[tuple[str, str]] = []  # a fake publisher: (job, queue)
    sweep = ExportSweep(redis_client, index, lambda job, tid, queue: sent.append((job, queue)), interval_s=1,
                        stale_s=600, ttl=3600, default_queue="ocrq", owner="w1")
    _job(index, "lost", 3, 3)  # finished; its one request failed (no flag)
    _job(index, "running", 1, 3)  # not finished
    _job(index, "asked", 2, 2)  # finished; asked for a minute ago
    redis_client.set(keys.job_finishing("asked"), repr(time.time() - 60))
    _job(index, "given-up", 2, 2)  # finished; asked for an hour ago, never written
    redis_client.set(keys.job_finishing("given-up"), repr(time.time() - 3600))
    _job(index, "old-flag", 2, 2)  # a flag of an older version, 2,000 s into its TTL
    redis_client.set(keys.job_finishing("old-flag"), "1", ex=3600 - 2000)
    _job(index, "archived", 2, 2)
    redis_client.set(keys.job_finishing("archived"), "1")
    assert index.archive("archived", 2) == 1
    _job(index, "submitting", 2, 2)
    redis_client.set(keys.job_submitting("submitting"), "1")
    redis_client.zadd(keys.JOBS, {"../../etc": time.time()})  # not a job name: never read
    assert sorted(sweep.sweep()) == ["given-up", "lost", "old-flag"]
    assert sorted(sent) == [("given-up", "q-given-up"), ("lost", "q-lost"), ("old-flag", "q-old-flag")]
    # one sweep per interval for the whole fleet
    other = ExportSweep(redis_client, index, lambda *a: sent.append(("x", "x")), interval_s=1, stale_s=600,
                        ttl=3600, default_queue="ocrq", owner="w2")
    assert other.sweep() == []
    time.sleep(1.1)
    # asked for now: the next sweep leaves them alone
    assert other.sweep() == [] and len(sent) == 3


def _hold_full(r: Any, stop: threading.Event) -> None:
    """The broker's Redis kept 1 MiB over its maxmemory (noeviction), as another client's data."""
    while not stop.is_set():
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) - (1 << 20))
        stop.wait(0.1)


def test_a_job_whose_last_image_ends_while_redis_is_full_gets_its_export(redis_url: str, redis_client: Any,
                                                                          start_worker: Any, tmp_path: Path) -> None:
    images = tmp_path / "in"
    word_images(images, 24)
    store = tmp_path / "store"
    start_worker(worker_env(redis_url, store, [tmp_path], OCRQ_ENGINE__KIND="simulated", OCRQ_QUEUE__CHUNK_SIZE="4",
                            OCRQ_ENGINE__EXTRA='{"image_latency_s": 0.1}', OCRQ_METRICS_PORT="0",
                            OCRQ_REDIS__EXPORT_SWEEP_S="1"))
    client = Client(settings_for(redis_url, store, limits={"allowed_roots": [tmp_path]}))
    stop = threading.Event()
    holder = threading.Thread(target=_hold_full, args=(redis_client, stop), daemon=True)
    try:
        job = client.submit([str(p) for p in sorted(images.iterdir())], job="full-at-the-end")
        redis_client.set("filler", b"\0" * (4 << 20))
        holder.start()
        time.sleep(0.3)
        with pytest.raises(Exception, match="maxmemory"):
            redis_client.set("probe", "x")  # Redis refuses writes now
        counts = job.wait(timeout=120, poll=0.5)
        assert counts["done"] == 24
        # held full past the last image: the export and the archive still happen
        deadline = time.monotonic() + 30
        while not (job.export_marker() and client.index.archived(job.name)) and time.monotonic() < deadline:
            time.sleep(0.5)
        still_full = holder.is_alive()
        assert job.export_marker() is not None, "no _SUCCESS while Redis was full"
        assert client.index.archived(job.name) and not redis_client.exists(keys.job_images(job.name))
        assert still_full
    finally:
        stop.set()
        holder.join(5)
        redis_client.config_set("maxmemory", 0)
        redis_client.delete("filler")
        client.close()
