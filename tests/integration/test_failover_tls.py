"""Redis failover over TLS: three redis-server with only a TLS port (``tls-replication yes``) and
three Sentinels with only a TLS port that talk TLS to the servers, on a certificate made here
(bench.chaos.security.self_signed, the chaos suite's rediss:// one). A real ``ocrq worker`` and
``ocrq submit --wait`` on ``sentinel://…`` with ``redis.sentinel_tls`` and ``sentinel_tls_ca``
complete a job; after a SIGKILL of the master and a promotion, a second ``submit --wait``
completes: the worker and the producer follow the new master over TLS, and ``ocrq flower`` still
lists the worker and reads the queue depth there."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from bench.chaos.security import self_signed
from ocrq.settings import RedisSettings
from ocrq_cli.embedded.ha_redis import HaRedis
from ocrq_cli.embedded.stack import stop_group, wait_worker_state
from tests.conftest import _need, _redis_binary, free_port
from tests.fixtures.images import word_images
from tests.integration.conftest import worker_env
from tests.integration.test_failover import _http, _until

pytestmark = pytest.mark.integration


class TlsHaRedis(HaRedis):
    """``HaRedis`` with every server and Sentinel on a TLS port only (``port 0``)."""

    cert: Path
    key: Path

    def _tls_lines(self) -> list[str]:
        return [f"tls-cert-file {self.cert}", f"tls-key-file {self.key}", f"tls-ca-cert-file {self.cert}",
                "tls-auth-clients no", "tls-replication yes"]

    def _to_tls(self, conf: Path) -> Path:
        lines = conf.read_text().splitlines()
        out = []
        for line in lines:
            if line.startswith("port "):
                out += ["port 0", f"tls-{line}"]
            else:
                out.append(line)
        conf.write_text("\n".join(out + self._tls_lines()) + "\n")
        return conf

    def _server_conf(self, i: int, replica_of: int | None) -> Path:
        return self._to_tls(super()._server_conf(i, replica_of))

    def _sentinel_conf(self, j: int, master_port: int) -> Path:
        return self._to_tls(super()._sentinel_conf(j, master_port))

    def _tls(self) -> dict[str, Any]:
        return {"ssl": True, "ssl_ca_certs": str(self.cert)}

    def server(self, i: int, timeout: float = 1.0) -> redis.Redis:
        return redis.Redis(port=self.data_ports[i], password=self.password, socket_timeout=timeout,
                           socket_connect_timeout=timeout, **self._tls())

    def sentinel(self, j: int = 0) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[j], socket_timeout=1.0, socket_connect_timeout=1.0,
                           **self._tls())


@pytest.fixture()
def tls_ha(tmp_path: Path) -> Iterator[TlsHaRedis]:
    binary = _redis_binary()
    if not binary:
        _need("redis-server")
    cert, key = self_signed(tmp_path / "tls")
    server = TlsHaRedis(str(binary), tmp_path / "ha", data_ports=(free_port(), free_port(), free_port()),
                        sentinel_ports=(free_port(), free_port(), free_port()))
    server.cert, server.key = cert, key
    try:
        server.start()
    except RuntimeError:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((tmp_path / "ha").glob("*.log")))
        if "TLS" in logs and "not" in logs.lower():
            _need(f"redis-server built with TLS (Debian's):\n{logs}")
        server.stop()
        raise RuntimeError(logs) from None
    yield server
    server.stop()


def _submit(env: dict[str, str], folder: Path, job: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "ocrq_cli", "submit", str(folder), "--job", job, "--wait",
                          "--timeout", "90"], env=env, capture_output=True, text=True, timeout=120)
    return run, time.monotonic() - started


def test_work_follows_the_new_master_over_tls(tls_ha, tmp_path):
    # Given the Sentinel URL with TLS to the Sentinels and the servers, and a worker on it
    env = worker_env(tls_ha.url, tmp_path / "store", [tmp_path], OCRQ_REDIS__SENTINEL_TLS="true",
                     OCRQ_REDIS__SENTINEL_TLS_CA=str(tls_ha.cert), OCRQ_ENGINE__KIND="simulated",
                     OCRQ_ENGINE__EXTRA=json.dumps({"image_latency_s": 0.01}), OCRQ_QUEUE__CHUNK_SIZE="2",
                     OCRQ_REDIS__DEAD_WORKER_S="6", OCRQ_REDIS__REAPER_INTERVAL_S="2", OCRQ_METRICS_PORT="0")
    rs = RedisSettings(url=tls_ha.url, sentinel_tls=True, sentinel_tls_ca=tls_ha.cert)
    log = tmp_path / "worker.log"
    worker = subprocess.Popen([sys.executable, "-m", "ocrq_cli", "worker", "--concurrency", "2",
                               "--name", "tls@%h"], env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    flower_port, auth = free_port(), "ops:tls-flower-secret"
    flower_log = tmp_path / "flower.log"
    flower = subprocess.Popen([sys.executable, "-m", "ocrq_cli", "flower", "--address", "127.0.0.1"],
                              env={**env, "OCRQ_FLOWER_PORT": str(flower_port), "OCRQ_FLOWER_BASIC_AUTH": auth,
                                   "OCRQ_VAR_DIR": str(tmp_path / "var")},
                              stdout=flower_log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{flower_port}"
    try:
        wait_worker_state(tls_ha.url, f"tls@{socket.gethostname()}", 120, lambda: worker.poll() is None,
                          lambda: "\n" + log.read_text()[-4000:], rs)
        # When a job is submitted and waited for
        word_images(tmp_path / "in1", 6)
        first, took = _submit(env, tmp_path / "in1", "tls-before")
        print(f"submit --wait before the failover: {took:.1f} s")
        # Then every image is done
        assert first.returncode == 0, first.stdout + first.stderr + log.read_text()[-3000:]

        # When the master is SIGKILLed and a replica promoted
        old = tls_ha.master_port()
        assert old is not None
        tls_ha.kill(tls_ha.data_ports.index(old))
        failover = tls_ha.wait_failover(old)
        print(f"promotion {failover:.1f} s after the kill")
        new = tls_ha.master_port()
        assert new is not None and new != old
        # (a master over TLS with its replica in sync: writes need min-replicas-to-write 1)
        tls_ha.restart(tls_ha.data_ports.index(old))

        # Then a second job submitted and waited for completes on the new master, over TLS
        word_images(tmp_path / "in2", 6, seed=1)
        second, took = _submit(env, tmp_path / "in2", "tls-after")
        print(f"submit --wait after the failover: {took:.1f} s")
        assert second.returncode == 0, second.stdout + second.stderr + log.read_text()[-3000:]
        assert tls_ha.server(tls_ha.data_ports.index(new)).info("replication")["role"] == "master"
        assert worker.poll() is None, log.read_text()[-3000:]

        # and Flower, on the same settings, lists the worker and reads the (drained) queue
        def flower_alive() -> bool:
            return flower.poll() is None

        def flower_tail() -> str:
            return flower_log.read_text(errors="replace")[-3000:]

        _until(lambda: _http(base + "/api/workers?refresh=1", auth),
               lambda w: isinstance(w, dict) and any(n.startswith("tls@") for n in w), 60, flower_alive, flower_tail)
        lengths = _until(lambda: _http(base + "/api/queues/length", auth), lambda q: isinstance(q, dict), 30,
                         flower_alive, flower_tail)
        assert {"name": "ocrq", "messages": 0} in lengths["active_queues"], lengths
    finally:
        if flower.poll() is None:
            os.killpg(flower.pid, 15)
        flower.wait(15)
        stop_group(worker, 30)
        print("--- worker.log (tail) ---\n" + log.read_text(errors="replace")[-3000:])
