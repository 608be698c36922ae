"""`ocrq up` / `ocrq down` from more than one directory, with real processes: the stack started
in one directory (Redis used as is, a real worker, Flower), then the CLI run from others."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from ocrq import keys
from ocrq.settings import Settings
from ocrq_cli.embedded.stack import Stack
from tests.conftest import free_port


def _cli(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ocrq_cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=120)


def _status(url: str, auth: str | None = None) -> int:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:  # Flower still binding
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def test_up_and_down_from_another_directory_name_the_stack_that_runs(
        redis_url: str, redis_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**os.environ, "OCRQ_REDIS__URL": redis_url, "OCRQ_ENGINE__KIND": "simulated",
           "OCRQ_FLOWER_PORT": str(free_port()), "OCRQ_FLOWER_BASIC_AUTH": "ops:test",
           "OCRQ_API__PORT": str(free_port()),
           "OCRQ_METRICS_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    for name in ("OCRQ_CONFIG", "OCRQ_VAR_DIR", "OCRQ_LIMITS__ALLOWED_ROOTS"):
        env.pop(name, None)
    here, there, third = (tmp_path / d for d in ("here", "there", "third"))
    for d in (here, there, third):
        d.mkdir()
    # Given the stack started in one directory
    for key, value in env.items():
        if key.startswith("OCRQ_"):
            monkeypatch.setenv(key, value)
    for name in ("OCRQ_CONFIG", "OCRQ_VAR_DIR", "OCRQ_LIMITS__ALLOWED_ROOTS"):  # `make test` exports OCRQ_VAR_DIR
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(here)
    stack = Stack(Settings())
    try:
        stack.up(wait=180)
        # Flower answers behind basic auth, and its password is not on its command line
        flower = stack.pid("flower")
        assert flower is not None and b"ops:test" not in Path(f"/proc/{flower}/cmdline").read_bytes()
        base = f"http://127.0.0.1:{env['OCRQ_FLOWER_PORT']}/api/workers"
        assert _status(base) == 401 and _status(base, "ops:test") == 200
        # the local stack's worker serves its metrics on loopback only, as Redis and Flower
        metrics = int(env["OCRQ_METRICS_PORT"])
        worker = psutil.Process(stack.pid("worker"))
        deadline = time.monotonic() + 30
        while not (bound := {c.laddr.ip for c in worker.net_connections("tcp")
                             if c.status == psutil.CONN_LISTEN and c.laddr.port == metrics}):
            assert time.monotonic() < deadline, "the worker's metrics port never listened"
            time.sleep(0.2)
        assert bound == {"127.0.0.1"}, bound
        node = f"embedded@{socket.gethostname()}"
        state = json.loads(redis_client.get(keys.worker_state(node)))
        assert state["process"]["var_dir"] == str(here / "var")
        # When `ocrq up` runs in another directory against the same Redis
        second = _cli(["up", "--wait", "20"], there, env)
        # Then it refuses (exit 2), names the running stack and starts nothing
        out = " ".join(second.stderr.split())
        assert second.returncode == 2, second.stderr
        assert f"already runs on {redis_url}, from the stack in {here / 'var'}" in out, out
        assert not (there / "var" / "run" / "worker.pid").exists()
        # When `ocrq down` runs in a third directory: nothing stopped, and it says where the stack is
        down = _cli(["down"], third, env)
        out = " ".join(down.stderr.split())
        assert down.returncode == 1, down.stderr
        assert f"runs from {here / 'var'}" in out and f"run `ocrq down` in {here}" in out, out
        assert stack.pid("worker") is not None and stack.pid("flower") is not None
    finally:
        stopped = stack.down()
    assert stopped["worker"].startswith("stopped") and stopped["flower"].startswith("stopped"), stopped
    # and with nothing running anywhere, `down` is a no-op that says so (exit 0: `make demo` runs it first)
    again = _cli(["down"], third, env)
    assert again.returncode == 0 and "no stack was running" in " ".join(again.stderr.split()), again.stderr
