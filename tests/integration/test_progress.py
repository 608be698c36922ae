"""A job's progress between its chunk records, against a real Redis and a real worker: it moves
image by image (a 64-image chunk is recorded at once), at least every second, with a rate and an
ETA; the progress hash stays within its bound and writes nothing for a job that does not exist."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from ocrq import keys
from ocrq.jobs.progress import BUCKET_S, BUCKETS, TTL_S, ProgressScript, engines
from producer.client import Client
from producer.progress import job_progress
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration


def test_the_progress_hash_is_bounded(redis_client: Any) -> None:
    script = ProgressScript(redis_client)
    # no meta, no job: nothing is written for it
    script.bump("ghost", 1000.0, 3, 3, "rapidocr", "cpu")
    assert not redis_client.exists(keys.job_progress("ghost"))
    redis_client.hset(keys.job("real"), "created", "1")
    t0 = 1_000_000.0
    for i in range(3 * BUCKETS):  # half an hour of windows, each with images
        script.bump("real", t0 + i * BUCKET_S, 2, 3, "rapidocr", "cpu")
    held = redis_client.hgetall(keys.job_progress("real"))
    assert len(held) == BUCKETS + 1 and int(held[b"engine"]) == 6 * BUCKETS
    assert 0 < redis_client.ttl(keys.job_progress("real")) <= TTL_S
    # a worker whose clock runs behind adds old windows: the oldest go, the bound holds
    for i in range(10):
        script.bump("real", t0 + i * BUCKET_S, 0, 1, "vllm", "gpu")
    assert len(redis_client.hgetall(keys.job_progress("real"))) == BUCKETS + 1
    assert redis_client.memory_usage(keys.job_progress("real")) < 8192  # a few KB at its bound
    # one whose clock runs ahead: what is older than the kept windows goes
    script.bump("real", t0 + 10 * BUCKETS * BUCKET_S, 0, 1, "vllm", "gpu")
    assert len(redis_client.hgetall(keys.job_progress("real"))) == 2
    raw = redis_client.hgetall(keys.job("real"))
    meta = {k.decode(): json.loads(v) if k != b"created" else v for k, v in raw.items()}
    assert engines(meta) == {"rapidocr": "cpu", "vllm": "gpu"}


def test_progress_moves_image_by_image_within_a_chunk(redis_url: str, start_worker: Any, tmp_path: Path) -> None:
    # Given one chunk of 64 images on an engine that takes 0.1 s per image, 4 per batch
    word_images(tmp_path / "in", 64, seed=5)
    store = tmp_path / "store"
    start_worker(worker_env(redis_url, store, [tmp_path], OCRQ_ENGINE__KIND="simulated",
                            OCRQ_ENGINE__EXTRA=json.dumps({"image_latency_s": 0.1})))
    client = Client(settings_for(redis_url, store, limits={"allowed_roots": [tmp_path]}))
    client.submit([str(tmp_path / "in")], job="steps")
    # When it is followed
    seen: list[tuple[float, int, int, float, float | None]] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        p = job_progress(client.redis, client.index, "steps")
        seen.append((time.monotonic(), p.finished, p.final, p.img_per_s, p.eta_s))
        if p.complete:
            break
        time.sleep(0.1)
    assert seen[-1][1] == seen[-1][2] == 64, seen[-1]
    # Then before the chunk is recorded (final 0) the count moves image by image, with a rate and ETA
    before = [s for s in seen if s[2] == 0]
    steps = sorted({s[1] for s in before})
    assert len(steps) >= 8 and 0 < steps[1] < 64, steps
    assert any(rate > 0 and eta is not None for _, _, _, rate, eta in before)
    # and while the engine works it changes at least every second
    moving = [s for s in before if 0 < s[1] < 60]
    changes = [t for (t, n, *_), (_, m, *_) in zip(moving, moving[1:], strict=False) if n != m]
    gaps = [b - a for a, b in zip(changes, changes[1:], strict=False)]
    assert gaps and max(gaps) < 1.2, gaps
