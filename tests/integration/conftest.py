"""Integration fixtures: a real `ocrq worker` (a Celery worker process) against the real Redis
server from tests/conftest.py, configured through OCRQ_* environment variables exactly as a
deployment would be."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ocrq import keys
from ocrq.settings import Settings
from ocrq_cli.embedded.stack import stop_group, wait_worker_state
from tests.conftest import free_port

WorkerFactory = Callable[..., subprocess.Popen[bytes]]


def worker_env(redis_url: str, store: Path, roots: list[Path], **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "OCRQ_REDIS__URL": redis_url,
        "OCRQ_STORE__KIND": "local",
        "OCRQ_STORE__PATH": str(store),
        "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(r) for r in roots]),
        "OCRQ_QUEUE__BACKOFF_BASE": "0.2",
        "OCRQ_QUEUE__BACKOFF_MAX": "1",
        # a stack started from this environment (`ocrq up`) serves its API on a port of its own
        "OCRQ_API__PORT": str(free_port()),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("OCRQ_CONFIG", None)
    env.update(extra)
    return env


@pytest.fixture()
def start_worker(redis_url: str, redis_client: Any, tmp_path: Path) -> Iterator[WorkerFactory]:
    """Factory: start_worker(env=dict, name=...) → a running, ready worker process (on a flushed Redis)."""
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(env: dict[str, str], name: str = "w1") -> subprocess.Popen[bytes]:
        log = tmp_path / f"worker-{name}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "ocrq_cli", "worker", "--concurrency", env.get("TEST_CONCURRENCY", "2"),
             "--name", f"{name}@%h"],
            env={**env, "OCRQ_TEST_WORKER_NAME": name}, stdout=log.open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append((proc, log))
        wait_worker_state(redis_url, f"{name}@{socket.gethostname()}", 300, lambda: proc.poll() is None,
                          lambda: "\n" + log.read_text()[-4000:])
        return proc

    yield start
    for proc, log in procs:
        stop_group(proc, 30)
        print(f"--- {log.name} (tail) ---\n" + log.read_text(errors="replace")[-3000:])


def settings_for(redis_url: str, store: Path, **overrides: Any) -> Settings:
    redis_settings = {"url": redis_url, **overrides.pop("redis", {})}
    return Settings(redis=redis_settings, store={"kind": "local", "path": store}, **overrides)


def worker_start_state(client: Any, name: str) -> dict[str, Any]:
    """The worker's published start (its state is refreshed every second)."""
    for _ in range(20):
        [state_key] = list(client.scan_iter(keys.worker_state(f"{name}@*")))
        start = json.loads(client.get(state_key))["start"]
        if start["ready_s"] is not None:
            return start
        time.sleep(0.5)
    raise AssertionError(f"no ready_s in {start}")
