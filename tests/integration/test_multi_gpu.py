"""Two GPU workers on one host, as `ocrq up --gpus 0,1` starts them: the real Stack spawning two
real `ocrq worker` processes (simulated engine, a fixed latency per batch, so each worker's share
is decided by the queue, not by CPU luck) with their own CUDA_VISIBLE_DEVICES, node names and
metrics ports on one Redis; and the shared governor snapshot, kept by the most-informed writer."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ocrq import keys
from ocrq.settings import Settings
from ocrq_cli.embedded.gpus import Gpu, plan_gpu_workers
from ocrq_cli.embedded.stack import Stack
from producer.client import Client
from tests.conftest import free_port
from tests.integration.conftest import settings_for, worker_env
from worker.heartbeat import save_snapshot

pytestmark = pytest.mark.integration

IMAGES = 400


def _distinct_images(folder: Path, n: int, seed: int = 13) -> None:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (48, 96, 3), dtype=np.uint8)).save(folder / f"{i:04d}.png")


def _two_free_ports() -> int:
    """A base port whose successor is free too (worker gpu1 serves on base + 1)."""
    for _ in range(50):
        base = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _scrape_done(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ocrq_images_total{") and 'outcome="done"' in line)


def test_two_gpu_workers_share_one_queue_fairly(redis_url: str, redis_client: Any, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the stack's settings: a simulated engine taking 0.3 s per batch of 16, chunks of 16
    _distinct_images(tmp_path / "in", IMAGES)
    metrics = _two_free_ports()
    for name, value in {
        "OCRQ_REDIS__URL": redis_url, "OCRQ_VAR_DIR": str(tmp_path / "var"),
        "OCRQ_STORE__KIND": "local", "OCRQ_STORE__PATH": str(tmp_path / "store"),
        "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(tmp_path)]),
        "OCRQ_ENGINE__KIND": "simulated", "OCRQ_ENGINE__EXTRA": json.dumps({"batch_latency_s": 0.3}),
        "OCRQ_BATCH__MODE": "fixed", "OCRQ_BATCH__SIZE": "16", "OCRQ_QUEUE__CHUNK_SIZE": "16",
        "OCRQ_QUEUE__CONCURRENCY": "4", "OCRQ_METRICS_PORT": str(metrics), "OCRQ_METRICS_ADDR": "127.0.0.1",
        "OCRQ_FLOWER_PORT": str(free_port()), "OCRQ_FLOWER_BASIC_AUTH": "ops:test", "PYTHONUNBUFFERED": "1",
        "OCRQ_API__PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OCRQ_CONFIG", raising=False)
    settings = Settings()
    host = socket.gethostname()
    # two GPUs as NVML would list them (this host has none: the simulated engine ignores the device)
    gpus = [Gpu(0, "GPU-00000000-test-0000-0000-000000000000"), Gpu(1, "GPU-11111111-test-1111-1111-111111111111")]
    stack = Stack(settings)
    try:
        # When `ocrq up --gpus 0,1` starts its plan
        status = stack.up(wait=180, workers=plan_gpu_workers(settings, gpus, host))
        assert {"worker-gpu0", "worker-gpu1"} <= set(status), status
        # Then each worker process runs with its own GPU, node name and metrics port
        for gpu in gpus:
            pid = stack.pid(f"worker-gpu{gpu.index}")
            assert pid is not None
            # the worker logs the device it was given (its /proc environ is overwritten by the
            # process title once setproctitle is installed, as in the vLLM venv)
            logged = (stack.log_dir / f"worker-gpu{gpu.index}.log").read_text()
            assert (f"CUDA_VISIBLE_DEVICES={gpu.uuid} CUDA_DEVICE_ORDER=PCI_BUS_ID "
                    f"metrics port {metrics + gpu.index}") in logged
            assert redis_client.exists(keys.worker_state(f"gpu{gpu.index}@{host}"))
        # and both registered as consumers of the one queue (each reserves an equal share of it)
        deadline = time.monotonic() + 10
        while redis_client.zcard(keys.queue_consumers(settings.queue.name)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        consumers = {m.decode() for m in redis_client.zrange(keys.queue_consumers(settings.queue.name), 0, -1)}
        assert consumers == {f"gpu0@{host}", f"gpu1@{host}"}
        # When 400 distinct images go through the producer
        client = Client(settings)
        t0 = time.monotonic()
        job = client.submit([str(tmp_path / "in")], job="two-gpus")
        counts = job.wait(timeout=300)
        # Then every image is done, both workers took part, and neither took more than 60%
        assert counts["done"] == IMAGES and counts["failed"] == 0, counts
        by_worker: dict[str, int] = {}
        for rec in job.records():
            assert rec.worker is not None
            by_worker[rec.worker] = by_worker.get(rec.worker, 0) + 1
        assert set(by_worker) == {f"gpu0@{host}", f"gpu1@{host}"}, by_worker
        assert max(by_worker.values()) <= 0.6 * IMAGES, by_worker
        # and each worker's own metrics port counts exactly its share
        scraped = {f"gpu{i}@{host}": _scrape_done(metrics + i) for i in (0, 1)}
        assert scraped == {k: float(v) for k, v in by_worker.items()}, (scraped, by_worker)
        print("per worker:", by_worker, f"job {time.monotonic() - t0:.1f}s")
    finally:
        stopped = stack.down()
    # `ocrq down` stops every worker it started
    assert stopped["worker-gpu0"].startswith("stopped") and stopped["worker-gpu1"].startswith("stopped"), stopped
    assert stack.pid("worker-gpu0") is None and stack.pid("worker-gpu1") is None
    # and a stopped worker no longer counts as a consumer of the queue: a worker started in its
    # place gets the whole window at once, not half of it until the old entry goes stale
    assert redis_client.zcard(keys.queue_consumers(settings.queue.name)) == 0


def _snap(observations: int) -> dict[str, Any]:
    return {"version": 1, "limit": 8, "slow_start": False,
            "calibration": {"points": [[1000.0, 2e9, False, False]], "surprises": [], "errors": [],
                            "observations": observations}}


def test_the_shared_snapshot_keeps_the_most_informed_learning(redis_client: Any) -> None:
    key = keys.governor_profile("test-fingerprint")
    # Given worker gpu0's snapshot after 10 batches
    assert save_snapshot(redis_client, key, _snap(10), 10)
    redis_client.expire(key, 100)
    # When gpu1, which started cold beside it, saves after 4 batches
    assert not save_snapshot(redis_client, key, _snap(4), 4)
    # Then gpu0's learning stays (its TTL refreshed: a live worker uses it), and later learning wins
    assert json.loads(redis_client.get(key))["calibration"]["observations"] == 10
    assert redis_client.ttl(key) > 100
    assert save_snapshot(redis_client, key, _snap(10), 10)  # an equally informed one may replace it
    assert save_snapshot(redis_client, key, _snap(12), 12)
    assert json.loads(redis_client.get(key))["calibration"]["observations"] == 12
    # and unreadable data (an older format, a person's edit) is replaced, not trusted
    redis_client.set(key, b"not json")
    assert save_snapshot(redis_client, key, _snap(1), 1)
    redis_client.set(key, json.dumps({"version": 0}))
    assert save_snapshot(redis_client, key, _snap(1), 1)


def test_governed_windows_split_a_job_evenly(redis_url: str, redis_client: Any, tmp_path: Path,
                                             start_worker: Any) -> None:
    # Given two GPU workers shaped like bench/gpu_multi.py: auto batches, chunks of 8, 32 chunk
    # threads, and warm governors, so each would reserve the whole job on its own (a batch takes
    # 0.3 s + 0.02 s per image)
    _distinct_images(tmp_path / "in", IMAGES)
    _distinct_images(tmp_path / "warm", 96, seed=7)
    env = worker_env(redis_url, tmp_path / "store", [tmp_path],
                     OCRQ_ENGINE__KIND="simulated", OCRQ_BATCH__MODE="auto", OCRQ_QUEUE__CHUNK_SIZE="8",
                     OCRQ_ENGINE__EXTRA=json.dumps({"batch_latency_s": 0.3, "image_latency_s": 0.02}),
                     OCRQ_METRICS_PORT="0", TEST_CONCURRENCY="32")
    host = socket.gethostname()
    gpus = [Gpu(0, "GPU-00000000-test"), Gpu(1, "GPU-11111111-test")]
    plans = plan_gpu_workers(Settings(engine={"kind": "simulated"}, metrics_port=0), gpus, host)
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]},
                                 queue={"chunk_size": 8}))
    # gpu0 learns first (its slow start), then gpu1 starts from the snapshot it saved
    start_worker({**env, **plans[0].env}, name="gpu0")
    assert client.submit([str(tmp_path / "warm")], job="warm").wait(timeout=300)["done"] == 96
    time.sleep(1.5)  # the snapshot is saved once a second
    start_worker({**env, **plans[1].env}, name="gpu1")
    state = json.loads(redis_client.get(keys.worker_state(f"gpu1@{host}")))
    assert state["restored_observations"] > 0, state
    # and both have seen each other on the queue (each refreshes that once a second)
    deadline = time.monotonic() + 10
    while redis_client.zcard(keys.queue_consumers("ocrq")) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.5)
    # When a job of 400 images (50 chunks) lands on the idle pair
    job = client.submit([str(tmp_path / "in")], job="even")
    assert job.wait(timeout=300)["done"] == IMAGES
    by_worker: dict[str, int] = {}
    for rec in job.records():
        by_worker[rec.worker or "?"] = by_worker.get(rec.worker or "?", 0) + 1
    print("per worker:", by_worker)
    # Then the split is near even: measured 200/200 (4 runs) and 216/184 with the fair share;
    # 240/160 and 232/168 without it (worker.prefetch before ocrq:consumers), whose first
    # poll took what its warm governor asked for
    assert set(by_worker) == {f"gpu0@{host}", f"gpu1@{host}"}, by_worker
    assert max(by_worker.values()) <= 0.57 * IMAGES, by_worker


def test_a_gpus_second_engine_starts_once_its_first_is_ready(redis_url: str, redis_client: Any, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the plan `engine.engines_per_gpu: 2` makes for one GPU (vllm there; the simulated engine
    # here, which ignores the device: the stack's ordering is what is under test)
    for name, value in {
        "OCRQ_REDIS__URL": redis_url, "OCRQ_VAR_DIR": str(tmp_path / "var"),
        "OCRQ_STORE__KIND": "local", "OCRQ_STORE__PATH": str(tmp_path / "store"),
        "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(tmp_path)]), "OCRQ_ENGINE__KIND": "simulated",
        "OCRQ_METRICS_PORT": "0", "OCRQ_FLOWER_PORT": str(free_port()), "OCRQ_FLOWER_BASIC_AUTH": "ops:test",
        "OCRQ_API__PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OCRQ_CONFIG", raising=False)
    host = socket.gethostname()
    gpu = Gpu(0, "GPU-00000000-test-0000-0000-000000000000")
    vllm = Settings(engine={"kind": "vllm", "engines_per_gpu": 2}, metrics_port=0)
    plans = plan_gpu_workers(vllm, [gpu], host)
    assert [p.node for p in plans] == [f"gpu0@{host}", f"gpu0.1@{host}"]
    stack = Stack(Settings())
    spawned: dict[str, bool] = {}
    spawn = stack._spawn

    def spawn_and_note(name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        # was the GPU's first worker ready (its state published) when this one was spawned?
        spawned[name] = bool(redis_client.exists(keys.worker_state(f"gpu0@{host}")))
        return spawn(name, argv, env)

    monkeypatch.setattr(stack, "_spawn", spawn_and_note)
    try:
        # When `ocrq up --gpus 0` starts the plan
        status = stack.up(wait=180, workers=plans)
        # Then the second engine was spawned only after the first had published its state, with
        # half the utilization, and both are up
        assert spawned == {"worker-gpu0": False, "worker-gpu0.1": True, "flower": True, "api": True}, spawned
        assert "OCRQ_ENGINE__GPU_MEMORY_UTILIZATION=0.425" in " ".join(f"{k}={v}" for k, v in plans[1].env.items())
        assert {"worker-gpu0", "worker-gpu0.1"} <= set(status), status
        assert redis_client.exists(keys.worker_state(f"gpu0.1@{host}"))
    finally:
        stopped = stack.down()
    assert stopped["worker-gpu0.1"].startswith("stopped"), stopped
