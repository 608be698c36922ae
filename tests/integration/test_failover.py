"""Redis failover under load: three real redis-server and three Sentinels (ocrq_cli.embedded.ha_redis), real
`ocrq worker` processes on the Sentinel URL, the producer's client on it too.

- a master killed (SIGKILL) mid-job: Sentinel promotes a replica, the workers follow it (a plain
  reconnect goes back to the dead address: celery#6348), every image ends final, none twice;
- a master demoted while workers hold connections to it: it answers READONLY (celery#7946) and
  the workers move to the new master;
- after either, a second job is consumed (workers that stopped consuming after a reconnect:
  celery#8030);
- redis-py's own Sentinel connection, as kombu and Celery use it, keeps writing to the demoted
  master's address after a retry: what ``FollowingConnection`` fixes;
- `ocrq flower` and `ocrq metrics` on the Sentinel URL show the worker and the queue depth, before
  and after a master is killed;
- `ocrq up --ha` from a fresh directory, a master killed by its pid, `submit --wait` before and after.

test_failover_tls.py runs a failover with TLS to the Sentinels and the servers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from base64 import b64encode
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest
import redis
from redis.sentinel import Sentinel

from ocrq.broker import publish, redis_conn
from ocrq.broker.queue import make_celery
from ocrq.settings import RedisSettings
from ocrq_cli.embedded.ha_redis import HaRedis
from ocrq_cli.embedded.stack import stop_group, wait_worker_state
from producer.client import Client
from tests.conftest import _need, _redis_binary, free_port
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration

#: ocrq's target for a failover: work resumes within this many seconds of a promotion
RESUME_MAX_S = 30.0


@pytest.fixture()
def ha(tmp_path: Path) -> Iterator[HaRedis]:
    binary = _redis_binary()
    if not binary:
        _need("redis-server")
    server = HaRedis(str(binary), tmp_path / "ha", data_ports=(free_port(), free_port(), free_port()),
                     sentinel_ports=(free_port(), free_port(), free_port()))
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def ha_workers(ha: HaRedis, tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(name: str, **extra: str) -> subprocess.Popen[bytes]:
        env = worker_env(ha.url, tmp_path / "store", [tmp_path], OCRQ_ENGINE__KIND="simulated",
                         OCRQ_ENGINE__EXTRA=json.dumps({"image_latency_s": 0.01}), OCRQ_BATCH__MODE="auto",
                         OCRQ_QUEUE__CHUNK_SIZE="4", OCRQ_REDIS__DEAD_WORKER_S="6",
                         OCRQ_REDIS__REAPER_INTERVAL_S="2", OCRQ_METRICS_PORT="0", **extra)
        log = tmp_path / f"worker-{name}.log"
        proc = subprocess.Popen([sys.executable, "-m", "ocrq_cli", "worker", "--concurrency", "2",
                                 "--name", f"{name}@%h"], env=env, stdout=log.open("wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((proc, log))
        wait_worker_state(ha.url, f"{name}@{socket.gethostname()}", 300, lambda: proc.poll() is None,
                          lambda: "\n" + log.read_text()[-4000:], RedisSettings(url=ha.url))
        return proc

    yield start
    for proc, log in procs:
        stop_group(proc, 30)
        print(f"--- {log.name} (tail) ---\n" + log.read_text(errors="replace")[-3000:])


def _client(ha: HaRedis, tmp_path: Path) -> Client:
    return Client(settings_for(ha.url, tmp_path / "store", limits={"allowed_roots": [tmp_path]},
                               queue={"chunk_size": 4}))


def _final(counts: dict[str, int]) -> int:
    return counts["done"] + counts["failed"]


def _ride(job: Any, event: Callable[[], float], at: int, timeout: float = 240) -> tuple[dict[str, int], float]:
    """Wait for ``job`` while calling ``event`` once ``at`` images are final; ``event`` returns the
    monotonic time of the promotion. Returns the final counts and the seconds from the promotion
    to the first image finished after it."""
    deadline = time.monotonic() + timeout
    promoted: float | None = None
    resumed: float | None = None
    final_then = 0
    while time.monotonic() < deadline:
        counts = job.status()
        if promoted is None and _final(counts) >= at:
            promoted = event()
            final_then = _final(job.status())
        elif promoted is not None and resumed is None and _final(counts) > final_then:
            resumed = time.monotonic() - promoted
        if _final(counts) >= counts["total"]:
            assert promoted is not None, "the job ended before the failover"
            return counts, resumed if resumed is not None else 0.0
        time.sleep(0.1)
    raise AssertionError(f"job {job.name} not final after {timeout:.0f}s: {job.status()}")


def _check_job(job: Any, n: int) -> None:
    counts = job.status()
    assert counts["total"] == n and counts["done"] == n and counts["failed"] == 0, counts
    job.wait_export(timeout=60)  # read once the job is exported and archived: its results index
    ids = [r.record.id for r in job.results()]
    assert len(ids) == n and len(set(ids)) == n  # every image once: none lost, none twice


def test_a_master_killed_mid_job_loses_no_image(ha, ha_workers, tmp_path):
    # Given two workers on the Sentinel URL and a job of 400 images
    word_images(tmp_path / "in", 400)
    ha_workers("w1")
    ha_workers("w2")
    client = _client(ha, tmp_path)
    job = client.submit([str(tmp_path / "in")], job="killed")

    # When the master is SIGKILLed a quarter of the way through
    def kill() -> float:
        old = ha.master_port()
        assert old is not None
        ha.kill(ha.data_ports.index(old))
        ha.wait_failover(old)
        promoted = time.monotonic()
        ha.restart(ha.data_ports.index(old))  # back as a replica of the new master
        return promoted

    counts, resumed = _ride(job, kill, at=100)
    print(f"killed master: work resumed {resumed:.1f} s after the promotion")
    # Then every image is done exactly once, and work resumed soon after the promotion
    _check_job(job, 400)
    assert resumed <= RESUME_MAX_S, resumed
    # and the workers keep consuming: a second job after the reconnect (celery#8030)
    _second_job(client, tmp_path, "after-kill")


def _second_job(client: Client, tmp_path: Path, job: str) -> None:
    """Workers still consume after the reconnect (celery#8030): a new job runs whole."""
    word_images(tmp_path / "in2", 40, seed=1)
    second = client.submit([str(tmp_path / "in2")], job=job)
    second.wait(timeout=120)
    _check_job(second, 40)


def test_a_demoted_master_answering_readonly_is_left_for_the_new_one(ha, ha_workers, tmp_path):
    # Given a worker holding connections to the master, and a job running
    word_images(tmp_path / "in", 200)
    ha_workers("w1")
    client = _client(ha, tmp_path)
    job = client.submit([str(tmp_path / "in")], job="demoted")
    old = ha.master_port()

    # When Sentinel demotes the master (it stays up, a replica now: READONLY to every write)
    def demote() -> float:
        ha.demote()
        ha.wait_failover(old or 0)
        return time.monotonic()

    counts, resumed = _ride(job, demote, at=50)
    print(f"demoted master: work resumed {resumed:.1f} s after the promotion")
    # Then the old master is a replica, the job finished on the new one, nothing lost or doubled
    assert ha.server(ha.data_ports.index(old or 0)).info("replication")["role"] == "slave"
    _check_job(job, 200)
    assert resumed <= RESUME_MAX_S, resumed
    # and a second job is consumed after the reconnect
    _second_job(client, tmp_path, "after-demotion")


def test_a_dropped_connection_reconnects_to_the_new_master_where_redis_py_s_goes_back(ha):
    # Given a connection of redis-py's Sentinel pool (as kombu and Celery build it) and one of
    # ocrq's, both connected to the master
    stock_pool = Sentinel([("127.0.0.1", p) for p in ha.sentinel_ports]).master_for(ha.master_name).connection_pool
    ours_pool = redis_conn.client(RedisSettings(url=ha.url)).connection_pool
    stock, ours = stock_pool.get_connection(), ours_pool.get_connection()
    old = ha.master_port()
    before = _series(ha)
    assert before["ocrq_redis_master"][0][0]["address"] == f"127.0.0.1:{old}"
    assert before["ocrq_redis_connected_replicas"][0][1] == 2 and before["ocrq_redis_sentinel"][0][1] == 1
    assert (stock.port, ours.port) == (old, old)
    # When Sentinel demotes the master (still up: a replica answering READONLY) and both
    # connections drop
    ha.demote()
    ha.wait_failover(old or 0)
    demoted = ha.server(ha.data_ports.index(old or 0))
    deadline = time.monotonic() + 30
    while demoted.info("replication")["role"] != "slave" and time.monotonic() < deadline:
        time.sleep(0.1)
    stock.disconnect()
    ours.disconnect()
    # Then sending a write reconnects ocrq's to the new master ...
    ours.send_command("SET", "k", "ours")
    assert ours.read_response() == b"OK" and ours.port == ha.master_port() != old
    # ... and redis-py's to the address it had: the demoted master, READONLY (celery#7946)
    stock.send_command("SET", "k", "stock")
    with pytest.raises(redis.RedisError, match="slave|replica|READONLY"):
        stock.read_response()
    assert stock.port == old
    # and `ocrq metrics` shows the new master, Sentinel's epoch one higher, the replicas' lag
    after = _series(ha)
    assert after["ocrq_redis_master"][0][0]["address"] == f"127.0.0.1:{ha.master_port()}"
    assert after["ocrq_redis_config_epoch"][0][1] == before["ocrq_redis_config_epoch"][0][1] + 1
    assert {labels["replica"] for labels, _ in after["ocrq_redis_replica_lag_bytes"]}


def test_a_publish_meeting_a_master_that_refuses_writes_waits_for_it_instead_of_failing(ha, tmp_path):
    """A master that refuses writes (NOREPLICAS, as a new master does until a replica is in sync, or
    READONLY from a replica a Sentinel still names) is a connection error kombu reconnects at
    once: its retries were spent in under a second and `ocrq submit` failed mid-publish
    ("The previous master is now a slave"). A publish now waits with backoff for the master."""
    # Given ocrq's Celery app on the Sentinel URL, connected (a first message published)
    app = make_celery(settings_for(ha.url, tmp_path / "store"))
    queue = "ride-out"
    publish.finish(app, "before", "finish-before", queue)
    master = ha.server(ha.master_index() or 0)
    # When the master refuses writes for 3 s
    master.config_set("min-replicas-to-write", 3)
    timer = threading.Timer(3.0, lambda: master.config_set("min-replicas-to-write", 1))
    timer.start()
    started = time.monotonic()
    try:
        publish.finish(app, "during", "finish-during", queue)
        took = time.monotonic() - started
    finally:
        timer.join()
        app.close()
    # Then the publish returned once the master took writes again, and both messages are queued
    print(f"publish waited {took:.1f} s for the master")
    assert took >= 2.5, took
    assert master.llen(queue) == 2


def _series(ha: HaRedis) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The replication series `ocrq metrics` serves for this HA Redis."""
    from ocrq.metrics.redis_series import replication_families

    rs = RedisSettings(url=ha.url)
    return {fam.name: [(s.labels, s.value) for s in fam.samples]
            for fam in replication_families(redis_conn.client(rs), rs)}


def test_a_submission_the_replicas_did_not_confirm_exits_5_and_the_same_command_completes_it(ha, tmp_path):
    """`ocrq submit` (refs, and an OpenAI Batch file) on a Sentinel URL asking more replicas than
    there are: written, not confirmed, exit 5 naming the setting; asking what there is, the same
    command again exits 0."""
    image = next(iter(word_images(tmp_path / "img", 1)))
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "ocrq", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(image)}}]}]}}) + "\n")
    commands = {"refs": ["submit", str(image), "--job", "acked"],
                "openai-batch": ["submit", "--openai-batch", str(batch), "--job", "acked-batch"]}
    for name, args in commands.items():
        for replicas, code in ((3, 5), (2, 0)):  # HaRedis runs a master and two replicas
            env = worker_env(ha.url, tmp_path / "store", [tmp_path], OCRQ_REDIS__ACK_REPLICAS=str(replicas),
                             OCRQ_REDIS__ACK_TIMEOUT_MS="200")
            run = subprocess.run([sys.executable, "-m", "ocrq_cli", *args], env=env, capture_output=True,
                                 text=True, timeout=120)
            out = run.stdout + run.stderr
            assert run.returncode == code, f"{name}, {replicas} replicas: {out[-2000:]}"
            if code == 5:
                assert "not confirmed" in out and "redis.ack_replicas" in out, out[-2000:]
    client = _client(ha, tmp_path)
    try:
        assert client.index.counts("acked")["total"] == 1 and client.index.counts("acked-batch")["total"] == 1
    finally:
        client.close()


def _http(url: str, auth: str | None = None) -> Any:
    """The body of a GET (JSON when it parses); None while nothing answers."""
    req = Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + b64encode(auth.encode()).decode())
    try:
        with urlopen(req, timeout=10) as resp:
            body = resp.read().decode()
    except HTTPError:
        raise
    except OSError:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body


def _until(what: Callable[[], Any], ok: Callable[[Any], bool], timeout: float, alive: Callable[[], bool],
           why: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got is not None and ok(got):
            return got
        assert alive() and time.monotonic() < deadline, f"last: {str(got)[:2000]}\n{why()}"
        time.sleep(0.3)


def _depth(metrics: str) -> float | None:
    """``ocrq_queue_depth{queue="ocrq"}`` in a Prometheus text page."""
    for line in metrics.splitlines():
        if line.startswith('ocrq_queue_depth{queue="ocrq"}'):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_flower_and_metrics_on_a_sentinel_url_show_the_worker_and_the_queue_depth(ha, ha_workers, tmp_path):
    # Given `ocrq flower` (behind basic auth) and `ocrq metrics` on the Sentinel URL
    auth = "ops:failover-flower-secret"
    flower_port, metrics_port = free_port(), free_port()
    env = worker_env(ha.url, tmp_path / "store", [tmp_path], OCRQ_FLOWER_PORT=str(flower_port),
                     OCRQ_FLOWER_BASIC_AUTH=auth, OCRQ_VAR_DIR=str(tmp_path / "var"))
    flower_log, metrics_log = tmp_path / "flower.log", tmp_path / "metrics.log"
    flower = subprocess.Popen([sys.executable, "-m", "ocrq_cli", "flower", "--address", "127.0.0.1"], env=env,
                              stdout=flower_log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    exporter = subprocess.Popen([sys.executable, "-m", "ocrq_cli", "metrics", "--port", str(metrics_port)],
                                env=env, stdout=metrics_log.open("wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{flower_port}"

    def logs() -> str:
        return (f"--- flower.log\n{flower_log.read_text(errors='replace')[-3000:]}\n"
                f"--- metrics.log\n{metrics_log.read_text(errors='replace')[-3000:]}")

    def alive() -> bool:
        return flower.poll() is None and exporter.poll() is None

    def depths() -> tuple[int | None, float | None] | None:
        lengths = _http(base + "/api/queues/length", auth)
        page = _http(f"http://127.0.0.1:{metrics_port}/metrics")
        if not isinstance(lengths, dict) or not isinstance(page, str):
            return None
        flower_depth = {q["name"]: q["messages"] for q in lengths.get("active_queues", [])}.get("ocrq")
        return flower_depth, _depth(page)

    try:
        _until(lambda: _http(base + "/healthcheck"), lambda body: body == "OK", 60, alive, logs)
        # Anonymous requests are refused
        with pytest.raises(HTTPError) as refused:
            _http(base + "/api/queues/length")
        assert refused.value.code == 401
        # When a job of 3 chunks waits, no worker yet
        word_images(tmp_path / "in", 6)
        client = _client(ha, tmp_path)
        job = client.submit([str(tmp_path / "in")], job="watched", priority=5)  # 4 + 2 refs: 2 chunks
        # Then both show its 2 messages (Flower sums the priority levels)
        _until(depths, lambda d: d == (2, 2.0), 30, alive, logs)

        # When the first Sentinel of the URL dies, then the master (SIGKILL) and a replica is
        # promoted by the other two
        ha.procs["sentinel-0"].kill()
        ha.procs["sentinel-0"].wait(10)
        old = ha.master_port()
        assert old is not None
        ha.kill(ha.data_ports.index(old))
        ha.wait_failover(old)
        ha.restart(ha.data_ports.index(old))
        # Then both read the same depth from the new master, through the Sentinels left (Flower
        # asked only the first one: ocrq.broker.celery_app)
        _until(depths, lambda d: d == (2, 2.0), 30, alive, logs)

        # When a worker drains the queue
        ha_workers("watch")
        counts = job.wait(timeout=120)
        assert counts["done"] == 6, counts
        # Then Flower lists the worker online, and both show the queue empty
        workers = _until(lambda: _http(base + "/api/workers?refresh=1", auth),
                         lambda w: isinstance(w, dict) and any(n.startswith("watch@") for n in w), 60, alive, logs)
        assert any(n.startswith("watch@") for n in workers), workers
        _until(depths, lambda d: d == (0, 0.0), 30, alive, logs)
    finally:
        for proc in (flower, exporter):
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
            proc.wait(15)
        print(logs())


def _ha_ports() -> list[int]:
    """Three free Sentinel ports whose server ports (20000 below: `ocrq up --ha`'s layout) are free."""
    ports: list[int] = []
    while len(ports) < 3:
        port = free_port()
        if port <= 21024 or port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port - 20000))
            except OSError:
                continue
        ports.append(port)
    return ports


def test_a_new_user_s_ocrq_up_ha_follows_a_master_killed_by_hand(tmp_path):
    """`ocrq up --ha` from a fresh directory, `ocrq submit --wait`, `kill -9` of the master's pid
    from var/run, a second `submit --wait`, `ocrq up --ha` again (the killed server back as a
    replica), `ocrq down`: the commands a person runs, each a process of its own."""
    if not _redis_binary():
        _need("redis-server")
    home = tmp_path / "newuser"
    word_images(home / "in1", 6)
    word_images(home / "in2", 6, seed=1)
    url = "sentinel://127.0.0.1:" + ";sentinel://127.0.0.1:".join(map(str, _ha_ports()))
    env = {k: v for k, v in os.environ.items() if k not in ("OCRQ_CONFIG", "OCRQ_LIMITS__ALLOWED_ROOTS")}
    env.update({"OCRQ_REDIS__URL": url, "OCRQ_VAR_DIR": str(home / "var"), "OCRQ_ENGINE__KIND": "simulated",
                "OCRQ_FLOWER_PORT": str(free_port()), "OCRQ_FLOWER_BASIC_AUTH": "ops:new-user",
                "OCRQ_METRICS_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"})
    run_dir = home / "var" / "run"

    def ocrq(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ocrq_cli", *args], cwd=home, env=env, text=True,
                              capture_output=True, timeout=timeout)

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                         for p in sorted((home / "var" / "log").glob("*.log")))

    rs = RedisSettings(url=url)
    try:
        up = ocrq("up", "--ha", "--wait", "120")
        assert up.returncode == 0, up.stdout + up.stderr + logs()
        first = ocrq("submit", "in1", "--job", "first", "--wait", "--timeout", "90", timeout=120)
        assert first.returncode == 0, first.stdout + first.stderr + logs()

        # When the person kills the master's redis-server by its pid file
        host, port = redis_conn.master_address(rs) or ("", 0)
        index = [int(p) - 20000 for p in url.replace("sentinel://127.0.0.1:", "").split(";")].index(port)
        pid = int((run_dir / f"redis-{index}.pid").read_text())
        os.kill(pid, 9)
        deadline = time.monotonic() + 60
        while True:
            try:  # while the master is down the Sentinels name none: MasterNotFoundError
                if (redis_conn.master_address(rs) or (host, port))[1] != port:
                    break
            except redis.RedisError:
                pass
            assert time.monotonic() < deadline, "no promotion after 60 s\n" + logs()
            time.sleep(0.2)

        # Then a second submit --wait completes on the new master
        second = ocrq("submit", "in2", "--job", "second", "--wait", "--timeout", "90", timeout=120)
        assert second.returncode == 0, second.stdout + second.stderr + logs()
        # and `ocrq up --ha` again starts the killed server, as a replica of the new master
        again = ocrq("up", "--ha", "--wait", "120")
        assert again.returncode == 0 and f"started again: redis-{index}" in again.stdout + again.stderr, \
            again.stdout + again.stderr
        back = redis.Redis(port=port, socket_timeout=2)
        deadline = time.monotonic() + 30
        while True:
            try:
                if back.info("replication")["role"] == "slave":
                    break
            except redis.ConnectionError:
                pass
            assert time.monotonic() < deadline, logs()
            time.sleep(0.2)
    finally:
        down = ocrq("down", timeout=120)
        print(down.stdout + down.stderr)
    assert down.returncode == 0 and "sentinel-0 stopped" in down.stdout + down.stderr, down.stdout + down.stderr
    assert not list(run_dir.glob("*.pid")), list(run_dir.glob("*.pid"))
