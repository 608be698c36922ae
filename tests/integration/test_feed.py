"""Submissions fed in windows (ocrq.jobs.feed), against a real Redis, real `ocrq worker` processes and
real `ocrq submit` processes: Redis holds at most the window's refs, whatever the submission's
size; the workers feed the rest; a producer killed mid-way resumes with no image sent twice."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kombu.utils.json import loads

from ocrq import keys
from ocrq.jobs.feed import WINDOW, submissions
from producer.client import Client
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration

WINDOW_IMAGES = 8192  # the smallest queue.window: two shards


def _files(folder: Path, n: int) -> list[Path]:
    """``n`` distinct small files (not images: each fails as BadImage at once, which is all the
    feeding needs)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"f{i:06d}.bin"
        path.write_bytes(i.to_bytes(4, "big"))
        paths.append(path)
    return paths


def _queued_refs(redis_client: Any, queue: str = "ocrq") -> int:
    """Refs in the broker's messages of ``queue`` (every priority level)."""
    n = 0
    for key in redis_client.scan_iter(match=f"{queue}*", _type="list"):
        if key.startswith(keys.PREFIX.encode()):
            continue
        for raw in redis_client.lrange(key, 0, -1):
            message = loads(raw)
            body = json.loads(base64.b64decode(message["body"]))
            n += len(body[0][0]["items"])
    return n


def test_redis_holds_at_most_the_window_and_the_workers_feed_the_rest(redis_url, redis_client, start_worker,
                                                                       tmp_path):
    # Given a submission of 3 windows' worth of refs and no worker yet
    n = 3 * WINDOW_IMAGES
    _files(tmp_path / "in", n)
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]},
                                 queue={"window": WINDOW_IMAGES}))
    job = client.submit([str(tmp_path / "in")], job="big")
    # Then every image is counted, but the queue holds only the window's refs; the rest are in the store
    assert job.published == n and job.status()["total"] == n and job.status()["queued"] == n
    assert _queued_refs(redis_client) == WINDOW_IMAGES
    (sub,) = submissions(redis_client, "big")
    assert sub.written == sub.windows == -(-n // WINDOW) and sub.fed == WINDOW_IMAGES // WINDOW
    # When a worker runs with the same window, it feeds the rest as the queue drains
    start_worker(worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_QUEUE__WINDOW=str(WINDOW_IMAGES)))
    counts = job.wait(timeout=300)
    # Then every image is final exactly once (each of these files fails as BadImage on attempt 1)
    assert counts["failed"] == n and counts["total"] == n, counts
    job.wait_export(timeout=60)
    lines = [r.record for r in job.results()]
    assert len(lines) == n and len({r.id for r in lines}) == n
    assert {r.attempts for r in lines} == {1}
    assert not redis_client.sismember(keys.FEEDING, "big")


def _submit(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ocrq_cli", "submit", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def test_a_producer_killed_mid_way_resumes_with_no_image_sent_twice(redis_url, redis_client, start_worker,
                                                                     tmp_path):
    n = 10 * WINDOW
    _files(tmp_path / "in", n)
    env = {**os.environ, "OCRQ_REDIS__URL": redis_url, "OCRQ_STORE__PATH": str(tmp_path / "store"),
           "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(tmp_path)]), "OCRQ_QUEUE__WINDOW": str(WINDOW_IMAGES)}
    env.pop("OCRQ_CONFIG", None)
    # Given a producer killed while it writes the submission's shards to the store
    for attempt in range(5):
        job = f"resume{attempt}"
        proc = _submit([str(tmp_path / "in"), "--job", job], env)
        written = 0
        while proc.poll() is None:
            subs = submissions(redis_client, job)
            written = subs[0].written if subs else 0
            if written >= 1:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
                break
            time.sleep(0.002)
        if 1 <= written < 10:
            break
    else:
        pytest.skip("the producer wrote every shard before it could be killed, five times")
    assert submissions(redis_client, job)[0].written < 10
    # When the same command runs again, and then a worker
    again = _submit([str(tmp_path / "in"), "--job", job], env)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert "accepted" in err
    worker_log = tmp_path / "worker-w1.log"
    start_worker(worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_QUEUE__WINDOW=str(WINDOW_IMAGES)))
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))
    handle = client.job(job)
    counts = handle.wait(timeout=300)
    # Then the job has every image once, and no image reached a worker twice
    assert counts["total"] == n and counts["failed"] == n, counts
    log = worker_log.read_text()
    delivered = sum(int(m) for m in re.findall(rf"→ fetch job={job} n=(\d+)", log))
    delivered += sum(int(m) for m in re.findall(rf"→ skip job={job} n=\d+: (\d+) image", log))
    assert delivered == n
    handle.wait_export(timeout=60)
    assert len({r.record.id for r in handle.results()}) == n


def test_a_job_whose_submission_is_being_written_does_not_finish(redis_client, tmp_path):
    """Workers run a submission's first windows while the rest is recorded: the job cannot
    finish (nor be exported) while its producer holds keys.job_submitting."""
    from ocrq.jobs.index import JobIndex
    from ocrq.output.export import export_job, request_export
    from ocrq.results import ImageRecord, ImageStatus
    from ocrq.store.sqlite_store import SqliteStore

    index = JobIndex(redis_client, ttl=60)
    index.create("j", {"task": "text"})
    index.record([ImageRecord(id="a", job="j", ref="/a", status=ImageStatus.queued)], mode="submit")
    index.record([ImageRecord(id="a", job="j", ref="/a", status=ImageStatus.failed)], part=1)
    sent: list[str] = []
    redis_client.set(keys.job_submitting("j"), "s1", ex=60)
    assert not request_export(redis_client, index, "j", sent.append, 60) and sent == []
    assert export_job(index, SqliteStore(tmp_path / "store"), "j")["exported"] is False
    redis_client.delete(keys.job_submitting("j"))
    assert request_export(redis_client, index, "j", sent.append, 60) and len(sent) == 1
