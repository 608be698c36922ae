"""A local HA Redis for ``ocrq up --ha`` and the failover tests: three redis-server (one master,
two replicas) and three Sentinels on loopback, from the binary the embedded stack uses.

Each server and Sentinel has a config file and data under ``{var}/redis-ha/{name}/`` (Sentinel
rewrites its file as it learns; servers keep their AOF), logs under ``{var}/log/``. The servers
refuse writes without a replica in sync (``min-replicas-to-write 1``, ``min-replicas-max-lag
10``): a master cut off from both replicas stops accepting what a failover would then lose.
Sentinels: quorum 2, ``down-after-milliseconds`` 2000, so a dead master is replaced in a few
seconds. A server started again after it died comes back as a replica of the current master.

docker-compose.yml's ``ha`` profile runs the same shape.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

#: data ports and Sentinel ports ``ocrq up --ha`` uses (configs/ha.yaml names the Sentinels)
DATA_PORTS = (6379, 6380, 6381)
SENTINEL_PORTS = (26379, 26380, 26381)
DOWN_AFTER_MS = 2000
FAILOVER_TIMEOUT_MS = 5000


def sentinel_url(ports: tuple[int, ...] | list[int], db: int = 0, password: str | None = None) -> str:
    """The ``redis.url`` of these Sentinels (Celery's format)."""
    auth = f":{password}@" if password else ""
    return ";".join(f"sentinel://{auth}127.0.0.1:{p}/{db}" for p in ports)


@dataclass
class HaRedis:
    """Three servers and three Sentinels. ``start()`` then ``stop()``; ``kill(i)`` and
    ``restart(i)`` act on one server (``master_index()`` says which one is master)."""

    binary: str
    root: Path
    data_ports: tuple[int, ...] = DATA_PORTS
    sentinel_ports: tuple[int, ...] = SENTINEL_PORTS
    master_name: str = "ocrq"
    password: str | None = None
    max_memory: int = 0
    down_after_ms: int = DOWN_AFTER_MS
    log_dir: Path | None = None
    #: where pid files go (default: ``root``); ``ocrq down`` stops what it finds there
    run_dir: Path | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return sentinel_url(self.sentinel_ports, password=self.password)

    def _dir(self, name: str) -> Path:
        d = self.root / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _spawn(self, name: str, conf: Path, sentinel: bool = False) -> None:
        logs = self.log_dir or self.root
        logs.mkdir(parents=True, exist_ok=True)
        out = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        argv = [self.binary, str(conf), *(["--sentinel"] if sentinel else [])]
        self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        run = self.run_dir or self.root
        run.mkdir(parents=True, exist_ok=True)
        (run / f"{name}.pid").write_text(str(self.procs[name].pid))

    def _server_conf(self, i: int, replica_of: int | None) -> Path:
        d = self._dir(f"redis-{i}")
        lines = [f"port {self.data_ports[i]}", "bind 127.0.0.1", f"dir {d}", "save \"\"", "appendonly yes",
                 "maxmemory-policy noeviction", "min-replicas-to-write 1", "min-replicas-max-lag 10",
                 "repl-diskless-sync yes", "repl-diskless-sync-delay 0"]
        if self.max_memory:
            lines.append(f"maxmemory {self.max_memory}")
        if self.password:
            lines += [f"requirepass {self.password}", f"masterauth {self.password}"]
        if replica_of is not None:
            lines.append(f"replicaof 127.0.0.1 {replica_of}")
        conf = d / "redis.conf"
        conf.write_text("\n".join(lines) + "\n")
        return conf

    def _sentinel_conf(self, j: int, master_port: int) -> Path:
        d = self._dir(f"sentinel-{j}")
        conf = d / "sentinel.conf"
        name = self.master_name
        lines = [f"port {self.sentinel_ports[j]}", "bind 127.0.0.1", f"dir {d}",
                 f"sentinel monitor {name} 127.0.0.1 {master_port} 2",
                 f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
                 f"sentinel failover-timeout {name} {FAILOVER_TIMEOUT_MS}",
                 f"sentinel parallel-syncs {name} 2"]
        if self.password:
            lines.append(f"sentinel auth-pass {name} {self.password}")
        conf.write_text("\n".join(lines) + "\n")
        return conf

    def start(self, timeout: float = 30.0) -> None:
        """Servers (the first one master), then Sentinels; returns once a write reaches a replica."""
        for i in range(len(self.data_ports)):
            self._spawn(f"redis-{i}", self._server_conf(i, None if i == 0 else self.data_ports[0]))
        for j in range(len(self.sentinel_ports)):
            self._spawn(f"sentinel-{j}", self._sentinel_conf(j, self.data_ports[0]), sentinel=True)
        self.wait_ready(timeout)

    def start_missing(self, running: Callable[[str], bool]) -> list[str]:
        """Start again the members ``running(name)`` says are not running (a server as a replica
        of the current master, a Sentinel from the configuration it rewrote); their names."""
        started = []
        for i in range(len(self.data_ports)):
            if not running(f"redis-{i}"):
                self.restart(i)
                started.append(f"redis-{i}")
        for j in range(len(self.sentinel_ports)):
            conf = self.root / f"sentinel-{j}" / "sentinel.conf"
            if not running(f"sentinel-{j}") and conf.exists():
                self._spawn(f"sentinel-{j}", conf, sentinel=True)
                started.append(f"sentinel-{j}")
        return started

    def server(self, i: int, timeout: float = 1.0) -> redis.Redis:
        return redis.Redis(port=self.data_ports[i], password=self.password, socket_timeout=timeout,
                           socket_connect_timeout=timeout)

    def sentinel(self, j: int = 0) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[j], socket_timeout=1.0, socket_connect_timeout=1.0)

    def master_port(self) -> int | None:
        """The master's port as a Sentinel that answers names it (None: none answers)."""
        for j in range(len(self.sentinel_ports)):
            try:
                addr = self.sentinel(j).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
            except redis.RedisError:
                continue
            if addr:
                return int(addr[1])
        return None

    def master_index(self) -> int | None:
        port = self.master_port()
        return self.data_ports.index(port) if port in self.data_ports else None

    def wait_ready(self, timeout: float = 30.0) -> int:
        """Wait until the Sentinels name a master that has a replica in sync; its index."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            i = self.master_index()
            if i is not None:
                try:
                    info = self.server(i).info("replication")
                    replicas = int(info.get("connected_slaves", 0))
                    if info.get("role") == "master" and replicas >= len(self.data_ports) - 1 \
                            and all(self._sentinel_knows(j) for j in range(len(self.sentinel_ports))):
                        return i
                except redis.RedisError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"HA Redis not ready after {timeout:.0f}s; see the logs under {self.log_dir or self.root}")

    def _sentinel_knows(self, j: int) -> bool:
        try:
            info = self.sentinel(j).execute_command("SENTINEL", "MASTER", self.master_name)
        except redis.RedisError:
            return False
        if isinstance(info, list):  # RESP2 without redis-py's parsing: a flat list
            info = dict(zip(info[::2], info[1::2], strict=False))
        fields = {str(k, "utf-8") if isinstance(k, bytes) else str(k): v for k, v in dict(info).items()}
        # every replica known too: a Sentinel that has not met them yet aborts a failover
        # ("-failover-abort-no-good-slave") and tries again only after 2 × failover-timeout
        return (int(fields.get("num-other-sentinels", 0)) >= len(self.sentinel_ports) - 1
                and int(fields.get("num-slaves", 0)) >= len(self.data_ports) - 1)

    def kill(self, i: int) -> None:
        """SIGKILL server ``i`` (a crash: no shutdown, no last write)."""
        proc = self.procs.get(f"redis-{i}")
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def restart(self, i: int) -> None:
        """Start server ``i`` again, as a replica of the current master."""
        port = self.master_port()
        self._spawn(f"redis-{i}", self._server_conf(i, port if port != self.data_ports[i] else None))

    def demote(self, timeout: float = 30.0) -> None:
        """Ask Sentinel to promote a replica now (``SENTINEL FAILOVER``; the master stays up, a
        replica). A Sentinel that read a replica's INFO while it was still syncing calls it no
        good replica (``NOGOODSLAVE``) until its next INFO, up to 10 s later: ask again until then."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sentinel(0).execute_command("SENTINEL", "FAILOVER", self.master_name)
                return
            except redis.ResponseError as exc:
                if "NOGOODSLAVE" not in str(exc) or time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    def wait_failover(self, old_port: int, timeout: float = 60.0) -> float:
        """Seconds until the Sentinels name a master other than ``old_port`` that takes writes."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            port = self.master_port()
            if port is not None and port != old_port:
                return time.monotonic() - start
            time.sleep(0.1)
        raise RuntimeError(f"no failover from :{old_port} after {timeout:.0f}s")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
