"""Cancel, as a user meets it through the Python client, against a real worker and Redis: at 10 %
and at 50 % of a job, what had not started never runs, what ran is kept, the job ends cancelled
with an export of what finished (its _SUCCESS says so), Redis keeps nothing of it per image, and
a reprocess runs the rest; a cancel after completion changes nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ocrq import keys
from producer.client import Client
from producer.errors import Conflict
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration

N = 240


def _slow_worker(redis_url: str, tmp_path: Path, start_worker) -> None:
    # a simulated engine at ~50 ms per image: the job takes ~12 s, long enough to cancel mid-way
    start_worker(worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_ENGINE__KIND="simulated",
                            OCRQ_ENGINE__EXTRA=json.dumps({"image_latency_s": 0.05}),
                            TEST_CONCURRENCY="2"), name="cancel")


def _wait_final(handle, timeout: float = 120) -> dict[str, int]:
    counts = handle.wait(timeout=timeout)
    marker = handle.wait_export(timeout=timeout)
    return {**counts, "_marker": marker}


@pytest.mark.parametrize("at", [0.1, 0.5])
def test_cancel_mid_job_keeps_what_ran_and_reprocess_runs_the_rest(redis_url, redis_client, start_worker,
                                                                     tmp_path: Path, at: float):
    # Given a job of 240 distinct images running on a slow worker
    src = tmp_path / "in"
    word_images(src, N)
    _slow_worker(redis_url, tmp_path, start_worker)
    # (chunks of 8: what runs at a cancel is the chunks the worker holds, a few of 8)
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]},
                                 queue={"chunk_size": 8}))
    job = f"cancel-{int(at * 100)}"
    handle = client.submit([str(src)], job=job)
    deadline = time.monotonic() + 120
    while handle.status()["done"] < at * N:
        assert time.monotonic() < deadline, handle.status()
        time.sleep(0.05)

    # When it is cancelled
    counts = handle.cancel()
    done_at_cancel = counts["done"]

    # Then what had not started never runs: the job ends with done + failed + cancelled = total
    final = _wait_final(handle)
    marker = final.pop("_marker")
    assert final["cancelled"] > 0 and final["done"] < N, final
    assert final["done"] + final["failed"] + final["cancelled"] == final["total"] == N, final
    # (the chunks running at the cancel finish: at most the worker's prefetched, running ones)
    assert final["done"] - done_at_cancel <= 2 * 2 * 8 + 8, (done_at_cancel, final)
    assert marker["cancelled"] is True and marker["counts"]["cancelled"] == final["cancelled"]
    assert handle.cancelled()
    # its export lists every image: the finished ones and the cancelled ones
    lines = [json.loads(line) for line in (tmp_path / "store" / keys.export_object(job, keys.EXPORT_JSONL))
             .read_text().splitlines()]
    statuses = [ln["status"] for ln in lines]
    assert len(lines) == N and statuses.count("cancelled") == final["cancelled"], marker
    assert statuses.count("done") == final["done"]
    # Redis keeps nothing of it per image (archived), and reads come from the store, whole
    assert not redis_client.exists(keys.job_images(job), keys.job_feed(job), keys.job_failed(job))
    assert not redis_client.sismember(keys.FEEDING, job)
    read = [r.record.status.value for r in handle.results()]
    assert sorted(read) == sorted(statuses)

    # A new submission to the cancelled job is refused (nothing is published) ...
    with pytest.raises(Conflict):
        client.submit([str(src)], job=job)

    # ... and a reprocess runs what the cancel stopped: every image done, the job no longer cancelled
    assert client.reprocess_failed(job, dry_run=True) == final["cancelled"]
    assert client.reprocess_failed(job) == final["cancelled"]
    again = _wait_final(handle)
    marker = again.pop("_marker")
    assert again["done"] == N and again["cancelled"] == 0, again
    assert "cancelled" not in marker and not handle.cancelled()
    assert sorted({r.record.status.value for r in handle.results()}) == ["done"]


def test_cancel_after_completion_changes_nothing(redis_url, redis_client, start_worker, tmp_path: Path):
    src = tmp_path / "in"
    word_images(src, 6)
    start_worker(worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_ENGINE__KIND="simulated"), name="done")
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))
    handle = client.submit([str(src)], job="finished")
    handle.wait(timeout=60)
    before = handle.wait_export(timeout=60)
    counts = handle.cancel()
    assert counts["done"] == 6 and counts["cancelled"] == 0
    assert not handle.cancelled()
    assert handle.export_marker() == before
