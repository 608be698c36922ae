"""Chaos scenario ``failover``: the broker is a Sentinel-managed HA Redis (ocrq_cli.embedded.ha_redis: three
redis-server, three Sentinels) and its master goes away under load.

During one job of the suite's images, submitted with ``ocrq submit --wait`` (a real CLI process on
the Sentinel URL, which must exit 0 having ridden through it all), with two real workers:

1. the master is SIGKILLed once a fifth of the images are final; Sentinel promotes a replica; the
   dead server is started again (a replica of the new master) a few seconds later;
2. the same again, on the new master, at half the images;
3. at four fifths, Sentinel demotes the master by hand (``SENTINEL FAILOVER``): it stays up, a
   replica answering READONLY to the workers still connected to it.

Measured: per event, the seconds from the promotion to the first image final after it ("resume");
each must be ≤ ``RESUME_MAX_S``. Then the suite's check (bench.chaos.verify): no image lost, none
twice, counts equal records, the export whole.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.chaos.stack import Workers
from bench.chaos.verify import Outcome, verify, wait_drained
from bench.services import free_port
from ocrq import keys
from ocrq.broker import redis_conn
from ocrq_cli.embedded.ha_redis import HaRedis
from ocrq_cli.embedded.stack import redis_binary

#: seconds from a promotion to the first image finished after it
RESUME_MAX_S = 30.0
#: (share of the images final, what happens then)
EVENTS = ((0.2, "kill"), (0.5, "kill"), (0.8, "demote"))


@dataclasses.dataclass
class _Url:
    """What the suite's worker_env and client_for read of its Redis: the URL."""

    url: str


def _event(ha: HaRedis, what: str) -> tuple[float, str]:
    """Do ``what`` to the current master; (monotonic time of the promotion, a note)."""
    old = ha.master_port()
    assert old is not None, "no master"
    i = ha.data_ports.index(old)
    if what == "kill":
        ha.kill(i)
    else:
        ha.demote()
    took = ha.wait_failover(old)
    promoted = time.monotonic()
    if what == "kill":
        def back() -> None:
            time.sleep(3.0)
            ha.restart(i)  # a replica of the new master

        threading.Thread(target=back, daemon=True).start()
    return promoted, f"{what} :{old} → :{ha.master_port()} promoted in {took:.1f}s"


def run_failover(env: Any, n: int, sim: dict[str, Any], worker_env: Callable[..., dict[str, str]],
                 client_for: Callable[[Any], Any], timeout_s: float) -> tuple[Outcome, float, list[str]]:
    """The scenario on ``env`` (bench.chaos's Env: images, S3, quick); (outcome, wall s, notes)."""
    binary = redis_binary()
    assert binary is not None, "no redis-server"
    ha = HaRedis(binary, env.root / "ha", data_ports=(free_port(), free_port(), free_port()),
                 sentinel_ports=(free_port(), free_port(), free_port()), log_dir=env.root / "logs" / "failover")
    ha.start()
    notes: list[str] = []
    here = dataclasses.replace(env, redis=_Url(ha.url))
    wenv = worker_env(here, sim)
    workers = Workers(wenv, env.root / "logs" / "failover", ha.url, n=2)
    client = client_for(here)
    job = "chaos-failover"
    refs = [str(p) for p in sorted(Path(env.images).iterdir())[:n]]
    ids = {keys.image_id(job, ref) for ref in refs}
    try:
        workers.start_all()
        t0 = time.monotonic()
        submit = subprocess.Popen([sys.executable, "-m", "ocrq_cli", "submit", *refs, "--job", job, "--wait",
                                   "--timeout", str(int(timeout_s))], env=wenv, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        while not client.index.exists(job) and submit.poll() is None:  # the CLI is planning
            time.sleep(0.2)
        resumes = _drive(ha, client.job(job), n, notes, t0 + timeout_s)
        out, _ = submit.communicate(timeout=max(60.0, t0 + timeout_s - time.monotonic() + 60))
        wall = time.monotonic() - t0
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and client.job(job).export_marker() is None:
            time.sleep(1.0)
        # a message a promotion left in unacked (acked on the old master, its ack lost with it) waits
        # for the reaper, as in every scenario: dead_worker_s + 2 × reaper_interval_s (bench.chaos)
        broker = redis_conn.client(client.settings.redis)
        drained = wait_drained(broker, client.settings.queue.name, 15 if env.quick else 150)
        if drained >= 1.0:
            notes.append(f"queue and unacked drained {drained:.0f}s after the job's export")
        time.sleep(2.0)  # the last acks land
        outcome = verify(broker, client.index, client.store, job, ids, client.settings.queue.name)
        if submit.returncode != 0:
            outcome.problems.append(f"submit --wait exited {submit.returncode}: {out[-400:]}")
        slow = [r for r in resumes if r > RESUME_MAX_S]
        if slow or len(resumes) < len(EVENTS):
            outcome.problems.append(f"work resumed after {resumes} s ({len(EVENTS)} events, ≤ {RESUME_MAX_S:.0f}s)")
        crashes = sum(p.read_text(errors="replace").count("Unrecoverable error") for p in workers.logs.glob("*.log"))
        if crashes:
            outcome.problems.append(f"{crashes} worker crash(es) (Celery 'Unrecoverable error') in the logs")
        notes.append("resumed " + ", ".join(f"{r:.1f}" for r in resumes) + " s after each promotion")
        return outcome, wall, notes
    finally:
        workers.stop_all()
        client.close()
        ha.stop()


def _drive(ha: HaRedis, job: Any, n: int, notes: list[str], deadline: float) -> list[float]:
    """Run EVENTS as the job crosses their shares; the resume time of each."""
    resumes: list[float] = []
    pending = list(EVENTS)
    promoted: float | None = None
    final_then = 0
    while time.monotonic() < deadline:
        try:
            counts = job.status()
        except Exception:  # noqa: BLE001 - Redis mid-failover: the next poll sees it
            time.sleep(0.2)
            continue
        final = counts["done"] + counts["failed"]
        if promoted is not None and final > final_then:
            resumes.append(time.monotonic() - promoted)
            promoted = None
        if promoted is None and pending and final >= pending[0][0] * n:
            _, what = pending.pop(0)
            promoted, note = _event(ha, what)
            notes.append(note)
            final_then = final
        if not pending and promoted is None and final >= n:
            break
        time.sleep(0.1)
    return resumes
