"""The services a chaos scenario runs against, each one breakable on purpose: redis-server with
AOF (``appendfsync everysec``) restartable on its port, moto's S3 server behind a TCP proxy that
can refuse connections, and ``ocrq worker`` processes that can be killed with SIGKILL."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.chaos.delays import KillLog
from bench.services import free_port
from ocrq_cli.embedded.stack import redis_binary, stop_group, wait_worker_state


@dataclass
class Special:
    """What a scenario changes beyond its fault: worker settings (env), a re-submit when the job
    stalls, its refs (from the scenario's env and image count), and a check of the final records by id (appends notes,
    returns problems)."""

    env: dict[str, str] = field(default_factory=dict)
    #: run the same submit again once the job has made no progress for this long (None: never)
    resubmit_after_s: float | None = None
    refs: Callable[[Any, int], list[str]] | None = None
    check: Callable[[Any, Workers, dict[str, Any], list[str]], list[str]] | None = None


class RedisServer:
    def __init__(self, data: Path) -> None:
        self.port = free_port()
        self.data = data
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"
        #: (when, AOF file, its size), the last few seconds (crash(lose_s=...))
        self._sizes: deque[tuple[float, Path, int]] = deque(maxlen=100)

    def start(self) -> None:
        binary = redis_binary()
        assert binary, "redis-server not found"
        self.data.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "everysec", "--dir", str(self.data)],
            stdout=(self.data / "redis.log").open("ab"), stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port)
        for _ in range(600):
            try:
                if client.ping():
                    threading.Thread(target=self._sample, args=(self.proc,), daemon=True).start()
                    return
            except (redis.ConnectionError, redis.BusyLoadingError):
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        """SIGTERM: Redis flushes the AOF and exits (a restart, not a crash)."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)
            self.proc = None

    def restart(self, down_s: float = 2.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def crash(self, down_s: float = 2.0, lose_s: float = 0.0) -> int:
        """SIGKILL of redis-server. Redis writes the AOF before it replies, so a process crash
        keeps every acknowledged write (the kernel still has them); a power loss also loses what
        was not fsynced yet, up to a second with ``appendfsync everysec``. ``lose_s`` emulates
        that: the AOF is cut back to its size ``lose_s`` seconds before the kill (sampled every
        50 ms) before the restart loads it (``aof-load-truncated``, on by default, drops a torn
        last command). Returns the bytes cut."""
        cut = 0
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(30)
            self.proc = None
        if lose_s:
            cut = self._truncate(time.monotonic() - lose_s)
        time.sleep(down_s)
        self.start()
        return cut

    def _aof(self) -> Path | None:
        found = sorted((self.data / "appendonlydir").glob("*.incr.aof"),
                       key=lambda p: int(p.name.split(".")[-3]))
        return found[-1] if found else None

    def _sample(self, proc: subprocess.Popen[bytes]) -> None:
        while self.proc is proc and proc.poll() is None:
            aof = self._aof()
            if aof is not None:
                try:
                    self._sizes.append((time.monotonic(), aof, aof.stat().st_size))
                except OSError:
                    pass
            time.sleep(0.05)

    def _truncate(self, at: float) -> int:
        aof = self._aof()
        before = [(t, p, n) for t, p, n in self._sizes if t <= at and p == aof]
        if aof is None or not before:
            return 0
        size = aof.stat().st_size
        keep = before[-1][2]
        os.truncate(aof, keep)
        return size - keep


class CuttableProxy:
    """A TCP proxy on a free port in front of ``target``; ``cut()`` closes the listener and every
    open connection (the endpoint is down: connections are refused), ``restore()`` reopens it."""

    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self.target = target_port
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def restore(self) -> None:
        lst = socket.socket()
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(("127.0.0.1", self.port))
        lst.listen(128)
        self._listener = lst
        threading.Thread(target=self._accept, args=(lst,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            lst, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        for s in [lst, *conns]:
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _accept(self, lst: socket.socket) -> None:
        while True:
            try:
                client, _ = lst.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass


class Workers:
    """``n`` named ``ocrq worker`` processes; ``kill_random`` SIGKILLs one and starts it again."""

    def __init__(self, env: dict[str, str], logs: Path, redis_url: str, n: int, concurrency: int = 4) -> None:
        self.env, self.logs, self.redis_url, self.concurrency = env, logs, redis_url, concurrency
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.names = [f"c{i}" for i in range(n)]
        self.kills = 0
        #: what each kill's victim held (bench.chaos.delays)
        self.kill_log = KillLog()
        #: processes started, first starts and restarts together
        self.starts = 0
        logs.mkdir(parents=True, exist_ok=True)

    def node(self, name: str) -> str:
        return f"{name}@{socket.gethostname()}"

    def start(self, name: str) -> None:
        log = self.logs / f"worker-{name}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "ocrq_cli", "worker", "--concurrency", str(self.concurrency), "--name",
             f"{name}@%h"], env=self.env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True)
        self.procs[name] = proc
        self.starts += 1
        wait_worker_state(self.redis_url, self.node(name), 300, lambda: proc.poll() is None,
                          lambda: str(log))

    def start_all(self) -> None:
        for name in self.names:
            self.start(name)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            client = redis.Redis.from_url(self.redis_url, socket_timeout=2, socket_connect_timeout=2)
            try:
                self.kill_log.snapshot(client, self.node(name))
            finally:
                client.close()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self.kills += 1

    def kill_random(self, rng: random.Random) -> str:
        name = rng.choice(self.names)
        self.kill(name)
        return name

    def restart_dead(self) -> list[str]:
        """Start again every worker whose process has exited (a crash-looping poison image too)."""
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        for name in dead:
            self.start(name)
        return dead

    def stop_all(self) -> None:
        for proc in self.procs.values():
            stop_group(proc, 30)
