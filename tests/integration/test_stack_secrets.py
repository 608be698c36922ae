"""The embedded stack's secrets, with real processes: `ocrq up` in a fresh directory starts its own
Redis with a generated password (kept 0600 beside Flower's, never on a command line), CONFIG
renamed for clients, the worker's metrics on loopback behind basic auth; every command run there
reaches the stack without being told the password, and no command prints any password it holds."""

from __future__ import annotations

import base64
import os
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import redis

from tests.conftest import free_port
from tests.fixtures.images import word_images

pytestmark = pytest.mark.integration


def _cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ocrq_cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


def _get(url: str, auth: str | None = None) -> int:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_ocrq_up_keeps_its_secrets(tmp_path: Path) -> None:
    here = tmp_path / "here"
    word_images(here / "scans", 2)
    port, metrics = free_port(), free_port()
    env = {**os.environ, "OCRQ_REDIS__URL": f"redis://127.0.0.1:{port}/0", "OCRQ_ENGINE__KIND": "simulated",
           "OCRQ_FLOWER_PORT": str(free_port()), "OCRQ_METRICS_PORT": str(metrics),
           "OCRQ_METRICS_BASIC_AUTH": "prom:metrics-pw-Q7x", "PYTHONUNBUFFERED": "1"}
    for name in ("OCRQ_CONFIG", "OCRQ_VAR_DIR", "OCRQ_LIMITS__ALLOWED_ROOTS", "OCRQ_FLOWER_BASIC_AUTH"):
        env.pop(name, None)
    outputs: list[str] = []
    try:
        up = _cli(["up", "--wait", "180"], here, env)
        outputs.append(up.stdout + up.stderr)
        assert up.returncode == 0, up.stderr
        auth_file, conf = here / "var" / "redis-auth", here / "var" / "redis" / "redis.conf"
        assert stat.S_IMODE(auth_file.stat().st_mode) == 0o600 and stat.S_IMODE(conf.stat().st_mode) == 0o600
        url = auth_file.read_text().split()[0]
        password = redis.Redis.from_url(url).connection_pool.connection_kwargs["password"]
        flower = (here / "var" / "flower-auth").read_text().strip().partition(":")[2]
        assert password and len(password) >= 24 and flower
        # Redis refuses a client without the password; CONFIG is no command for one with it
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        client = redis.Redis.from_url(url)
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.config_get("maxmemory")
        # no command line holds it (any local user reads them in ps)
        for proc in psutil.process_iter(["cmdline"]):
            assert password not in " ".join(proc.info["cmdline"] or []), proc.info["cmdline"]
        # the worker's metrics: loopback, basic auth
        bound = {c.laddr.ip for p in psutil.process_iter() for c in _listening(p) if c.laddr.port == metrics}
        assert bound == {"127.0.0.1"}, bound
        assert _get(f"http://127.0.0.1:{metrics}/metrics") == 401
        assert _get(f"http://127.0.0.1:{metrics}/metrics", "prom:metrics-pw-Q7x") == 200
        # commands run beside the stack reach it without being told the password
        for args in (["submit", "scans", "--job", "secrets", "--wait", "--timeout", "120"], ["status", "secrets"],
                     ["jobs"], ["failed"], ["governor"], ["up", "--wait", "60"]):
            done = _cli(args, here, env)
            outputs.append(done.stdout + done.stderr)
            assert done.returncode == 0, (args, done.stderr)
    finally:
        down = _cli(["down"], here, env)
        outputs.append(down.stdout + down.stderr)
    text = "\n".join(outputs)
    assert "started" in text and "redis-auth" in text  # `up` says where the password is ...
    for secret in (password, flower, "metrics-pw-Q7x"):
        assert secret not in text  # ... and no command prints one
    for name in ("redis", "worker", "flower"):
        assert not (here / "var" / "run" / f"{name}.pid").exists()


def _listening(proc: psutil.Process) -> list[psutil._common.pconn]:  # type: ignore[name-defined]
    try:
        return [c for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    except (psutil.AccessDenied, psutil.NoSuchProcess):
        return []


def test_the_password_is_kept_across_a_restart(tmp_path: Path) -> None:
    """`ocrq down` then `ocrq up` again: the same generated password (its AOF and clients' settings
    still match), read from var/redis-auth."""
    port = free_port()
    env = {**os.environ, "OCRQ_REDIS__URL": f"redis://127.0.0.1:{port}/0", "OCRQ_ENGINE__KIND": "simulated",
           "OCRQ_FLOWER_PORT": str(free_port()), "OCRQ_METRICS_PORT": "0", "PYTHONUNBUFFERED": "1"}
    for name in ("OCRQ_CONFIG", "OCRQ_VAR_DIR", "OCRQ_LIMITS__ALLOWED_ROOTS"):
        env.pop(name, None)
    try:
        assert _cli(["up", "--wait", "180"], tmp_path, env).returncode == 0
        first = (tmp_path / "var" / "redis-auth").read_text()
        assert _cli(["down"], tmp_path, env).returncode == 0
        time.sleep(0.5)
        again = _cli(["up", "--wait", "180"], tmp_path, env)
        assert again.returncode == 0, again.stderr
        assert (tmp_path / "var" / "redis-auth").read_text() == first
        assert redis.Redis.from_url(first.split()[0]).ping()
    finally:
        _cli(["down"], tmp_path, env)
