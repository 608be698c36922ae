"""``python -m bench.chaos [--quick] [--only NAME ...]``: the chaos scenarios, one summary table,
exit status 1 on any lost, duplicated or untrue record.

    kill    SIGKILL of a random worker every few seconds, restarted each time; the default
            visibility_timeout (3600 s): the reaper (worker.reaper) brings the chunks back.
            Measured: per image the victim held, the time from the kill to its final record
            (bench.chaos.delays); a p99 over 120 s is a problem
    redis   redis-server (AOF, appendfsync everysec) restarted twice during the load
    redis-crash  redis-server SIGKILLed right after the submit with its last second of AOF cut off
            (a power loss under appendfsync everysec), then SIGKILLed again under load (a process
            crash: the kernel keeps what Redis wrote); a job that stalls gets the same submit
            again (the documented recovery), noted with what was not final
    s3      the S3 endpoint refuses connections for 30 s (10 s in --quick), then comes back
    oom     10% of engine batches raise a CUDA-style OOM
    all     kill + redis + s3 + oom at once
    redis-full  the broker's Redis over its maxmemory (noeviction) for 60 s (10 s in --quick): a new
            submit is refused (exit 2, naming the setting), the running job goes on and loses nothing;
            in the full form the job ends while Redis is full and must get its export and archive then
    decoder 1% of the files (real PNGs) make the decoder abort (SIGABRT) or hang: each fails as
            RetriesExhausted naming DecoderCrashed after its attempts, its chunk-mates are done,
            no worker process dies (worker.decoding.decode isolates decoding in child processes)
    failover  the broker on a Sentinel-managed HA Redis (3 servers, 3 Sentinels): its master
            SIGKILLed twice and demoted by hand once during the job; the producer's submit --wait
            rides through; work resumes ≤ 30 s after each promotion (bench.chaos.failover)
    webhooks  jobs submitted through two API replicas, each naming a webhook: a replica SIGKILLed
            every 7 s, a worker every 11 s, the receiver down for the first 60 s (20 s in --quick):
            every job's terminal event delivered, verified, once per id (bench.chaos.webhooks)
    security  Redis with a password over TLS end to end, a pickle message, size caps, and a grep
            for credentials and presigned signatures in logs, Redis, Flower and the results
            (bench.chaos.security; 300 images in --quick)

The full form (``make reliability``) runs 2,000 images per scenario with production reaper
timings (dead_worker_s 60, reaper_interval_s 20); ``--quick`` (``make reliability-quick``, part
of ``make test``) runs the same 2,000 images with dead_worker_s 6 and reaper_interval_s 2 and a
10 s S3 outage.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import redis

from bench.chaos.delays import KILL_DELAY_P99_MAX_S, KillDelays, kill_delays
from bench.chaos.failover import run_failover
from bench.chaos.poison import poison_special
from bench.chaos.security import run_security
from bench.chaos.stack import CuttableProxy, RedisServer, Special, Workers
from bench.chaos.verify import Outcome, verify, wait_drained
from bench.chaos.webhooks import run_webhooks
from bench.services import free_port
from ocrq import keys
from ocrq.settings import Settings
from producer.client import Client
from tests.fixtures.images import word_images
from worker.export_sweep import SWEEP_LOG
from worker.loop.oom import OOM_LOG


@dataclass
class Run:
    name: str
    outcome: Outcome
    wall_s: float
    notes: list[str] = field(default_factory=list)
    kill_delays: KillDelays | None = None


@dataclass
class Env:
    root: Path
    redis: RedisServer
    s3_proxy: CuttableProxy
    bucket: str
    images: Path
    quick: bool


def worker_env(env: Env, sim: dict[str, Any], extra: dict[str, str] | None = None) -> dict[str, str]:
    import os

    out = {**os.environ, "PYTHONUNBUFFERED": "1",
           "OCRQ_REDIS__URL": env.redis.url,
           "OCRQ_STORE__KIND": "s3", "OCRQ_STORE__BUCKET": env.bucket,
           "OCRQ_STORE__ENDPOINT_URL": f"http://127.0.0.1:{env.s3_proxy.port}",
           "OCRQ_STORE__ACCESS_KEY_ID": "testing", "OCRQ_STORE__SECRET_ACCESS_KEY": "testing",
           "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(env.images), str(env.root / "poison")]),
           "OCRQ_ENGINE__KIND": "simulated", "OCRQ_ENGINE__EXTRA": json.dumps(sim),
           "OCRQ_BATCH__MODE": "auto", "OCRQ_QUEUE__CHUNK_SIZE": "16", "OCRQ_LOG_LEVEL": "WARNING"}
    if env.quick:
        out.update({"OCRQ_REDIS__DEAD_WORKER_S": "6", "OCRQ_REDIS__REAPER_INTERVAL_S": "2"})
    # a finish message lost with a killed worker (killed between the job's `finishing` flag and
    # the publish, or between the broker's pop and its unacked entry) is asked for again once the
    # request is `export_stale_s` old: 900 s by default, past any wait here, so shorter
    out.update({"OCRQ_REDIS__EXPORT_SWEEP_S": "5" if env.quick else "10",
                "OCRQ_REDIS__EXPORT_STALE_S": "30" if env.quick else "60"})
    out.pop("OCRQ_CONFIG", None)
    out.update(extra or {})
    return out


def client_for(env: Env) -> Client:
    return Client(Settings(
        redis={"url": env.redis.url},
        store={"kind": "s3", "bucket": env.bucket, "endpoint_url": f"http://127.0.0.1:{env.s3_proxy.port}",
               "access_key_id": "testing", "secret_access_key": "testing"},
        limits={"allowed_roots": [env.images, env.root / "poison"]}, queue={"chunk_size": 16},
    ))


Fault = Callable[[Env, Workers, threading.Event, list[str]], None]


def no_fault(env: Env, workers: Workers, stop: threading.Event, notes: list[str]) -> None:
    stop.wait()


def kill_fault(every_s: float) -> Fault:
    def run(env: Env, workers: Workers, stop: threading.Event, notes: list[str]) -> None:
        rng = random.Random(7)
        while not stop.wait(every_s):
            name = workers.kill_random(rng)
            workers.start(name)
    return run


def redis_fault(at_s: tuple[float, ...]) -> Fault:
    def run(env: Env, workers: Workers, stop: threading.Event, notes: list[str]) -> None:
        t0 = time.monotonic()
        for at in at_s:
            if stop.wait(max(0.0, at - (time.monotonic() - t0))):
                return
            env.redis.restart(down_s=2.0)
            notes.append(f"redis restarted at {time.monotonic() - t0:.0f}s")
    return run


def redis_crash_fault(plan: tuple[tuple[float, float], ...]) -> Fault:
    """(at s, seconds of AOF lost): 0 is a process crash, 1 a power loss (bench.chaos.stack)."""
    def run(env: Env, workers: Workers, stop: threading.Event, notes: list[str]) -> None:
        t0 = time.monotonic()
        for at, lose_s in plan:
            if stop.wait(max(0.0, at - (time.monotonic() - t0))):
                return
            at_s = time.monotonic() - t0
            cut = env.redis.crash(down_s=2.0, lose_s=lose_s)
            notes.append(f"redis killed -9 at {at_s:.1f}s" + (f" with its last {lose_s:.0f}s of AOF lost"
                                                              f" ({cut} bytes)" if lose_s else ""))
    return run


def s3_fault(at_s: float, down_s: float) -> Fault:
    def run(env: Env, workers: Workers, stop: threading.Event, notes: list[str]) -> None:
        if stop.wait(at_s):
            return
        env.s3_proxy.cut()
        time.sleep(down_s)
        env.s3_proxy.restore()
        notes.append(f"S3 down {down_s:.0f}s")
    return run


def redis_full(at_s: float, hold_s: float, require_end: bool = False) -> tuple[Fault, Special]:
    """The broker's Redis over its maxmemory (noeviction) from ``at_s`` for ``hold_s`` (however
    soon the job ends): a filler of another client's, and maxmemory kept 1 MiB under what it holds
    (every 0.1 s). A new submit must be refused (exit 2, naming the setting), the running job must
    go on and lose nothing, and a job that ends while Redis is full must get its export and its
    archive then (``_SUCCESS`` before Redis has room again)."""
    seen: dict[str, Any] = {}

    def fault(env: Env, workers: Workers, stop: threading.Event, notes: list[str]) -> None:
        if stop.wait(at_s):
            return
        r = redis.Redis.from_url(env.redis.url)
        r.set("chaos:filler", b"\0" * (8 << 20))
        used = int(r.info("memory")["used_memory"])
        counts = r.hgetall(keys.job_counts("chaos-redis-full"))
        before = sum(int(counts.get(k, 0)) for k in (b"done", b"failed"))
        held = threading.Event()

        def hold() -> None:  # stays 1 MiB over its limit as the job's memory moves (another client's)
            while not held.is_set():
                r.config_set("maxmemory", int(r.info("memory")["used_memory"]) - (1 << 20))
                held.wait(0.1)

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        time.sleep(0.3)
        late = subprocess.run([sys.executable, "-m", "ocrq_cli", "submit", str(sorted(env.images.iterdir())[0]),
                               "--job", "chaos-redis-full-late"], env=worker_env(env, {}), capture_output=True,
                              text=True, timeout=120)
        seen["late"] = late
        time.sleep(max(0.0, hold_s - 0.3))  # the whole hold, even once the job has ended
        counts = r.hgetall(keys.job_counts("chaos-redis-full"))
        final = sum(int(counts.get(k, 0)) for k in (b"done", b"failed"))
        seen["ended_full"] = final >= int(counts.get(b"total", 1) or 1)
        reader = client_for(env)
        try:
            seen["exported_full"] = reader.job("chaos-redis-full").export_marker() is not None
        finally:
            reader.close()
        held.set()
        holder.join(5)
        seen["moved"] = final - before
        r.config_set("maxmemory", 0)
        r.delete("chaos:filler")
        ended = ("; the job ended while it was full and was exported " + ("then" if seen["exported_full"] else
                 "only after")) if seen["ended_full"] else ""
        notes.append(f"broker over its maxmemory ({(used >> 20) - 1} MiB) for {hold_s:.0f} s: a new submit exited"
                     f" {late.returncode}; {seen['moved']} images finished meanwhile{ended}")

    def check(env: Env, workers: Workers, records: dict[str, Any], notes: list[str]) -> list[str]:
        late = seen.get("late")
        problems = []
        if late is None:
            return ["the broker never reached its maxmemory (the job ended first)"]
        if late.returncode != 2 or "maxmemory" not in late.stderr:
            problems.append(f"a submit at maxmemory exited {late.returncode}: {late.stderr[-300:]}")
        if not seen.get("moved"):
            problems.append("no image finished while the broker was at its maxmemory")
        if seen.get("ended_full") and not seen.get("exported_full"):
            problems.append("the job ended while the broker was at its maxmemory and got no export then")
        if require_end and not seen.get("ended_full"):
            problems.append(f"the job did not end within the {hold_s:.0f} s at maxmemory (the hold must cover it)")
        return problems

    return fault, Special(check=check)


def together(*faults: Fault) -> Fault:
    def run(env: Env, workers: Workers, stop: threading.Event, notes: list[str]) -> None:
        threads = [threading.Thread(target=f, args=(env, workers, stop, notes), daemon=True) for f in faults]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return run


def wait_final(client: Client, job: Any, refs: list[str], ids: set[str], special: Special, deadline: float,
               notes: list[str]) -> None:
    """Until every accepted image is final (or the deadline). With ``special.resubmit_after_s``,
    a job that made no progress for that long gets the same submit again, republishing (the
    documented recovery after a Redis crash), noted with what was not final and what it sent."""
    progress, moved = -1, time.monotonic()
    while time.monotonic() < deadline:
        try:
            counts = job.status()
            final = counts["done"] + counts["failed"]
            # a crashed Redis may have lost records too: the target is every accepted image
            if final >= max(counts["total"], len(ids)):
                return
            if final != progress:
                progress, moved = final, time.monotonic()
            elif special.resubmit_after_s and time.monotonic() - moved > special.resubmit_after_s:
                again = client.submit(refs, job=job.name, params={"scenario": job.name.removeprefix("chaos-")},
                                      republish=True)
                notes.append(f"stalled {time.monotonic() - moved:.0f}s at {final}/{len(ids)} final"
                             f" ({len(ids) - final} not final); the same submit --republish sent {again.published}")
                moved = time.monotonic()
        except redis.RedisError:
            pass
        time.sleep(1.0)


def run_scenario(env: Env, name: str, n: int, sim: dict[str, Any], fault: Fault, timeout_s: float,
                 special: Special | None = None) -> Run:
    special = special or Special()
    client = client_for(env)
    r = redis.Redis.from_url(env.redis.url)
    r.flushdb()
    workers = Workers(worker_env(env, sim, special.env), env.root / "logs" / name, env.redis.url, n=2)
    workers.start_all()
    refs = special.refs(env, n) if special.refs else [str(p) for p in sorted(env.images.iterdir())[:n]]
    t0 = time.monotonic()
    job = client.submit(refs, job=f"chaos-{name}", params={"scenario": name})
    ids = {keys.image_id(job.name, ref) for ref in refs}
    stop = threading.Event()
    notes: list[str] = []
    thread = threading.Thread(target=fault, args=(env, workers, stop, notes), daemon=True)
    thread.start()
    wait_final(client, job, refs, ids, special, t0 + timeout_s, notes)
    if workers.kills:
        notes.append(f"{workers.kills} kills while the job ran")
    wall = time.monotonic() - t0
    # the job's export (ocrq.finish_job) runs once it finished; a worker killed holding its message
    # gives it back through the reaper (dead_worker_s + 2 × reaper_interval_s: 100 s, 10 s quick)
    deadline = time.monotonic() + 60 + (10 if env.quick else 100)
    while time.monotonic() < deadline:
        try:
            if job.export_marker() is not None:
                break
        except Exception:  # Redis or S3 may be down mid-fault
            pass
        time.sleep(1.0)
    stop.set()
    thread.join(120)
    # a worker killed just before the faults stopped holds a message (a chunk run again, the
    # export) until the reaper gives it back: dead_worker_s + 2 × reaper_interval_s
    drained = wait_drained(r, client.settings.queue.name, 15 if env.quick else 150)
    if drained >= 1.0:
        notes.append(f"queue and unacked drained {drained:.0f}s after the faults stopped")
    time.sleep(2.0)  # the last acks land, and workers publish their state once more
    outcome = verify(r, client.index, client.store, job.name, ids, client.settings.queue.name)
    asked = sum(p.read_text(errors="replace").count(SWEEP_LOG) for p in workers.logs.glob("*.log"))
    if asked:
        notes.append(f"the export sweep asked for the export again {asked} time(s)")
    if sim.get("oom_rate"):
        # counted from the workers' logs, which a killed worker leaves behind (its published state
        # dies with it, and a restarted worker starts counting from zero)
        ooms = sum(p.read_text(errors="replace").count(OOM_LOG) for p in workers.logs.glob("*.log"))
        notes.append(f"{ooms} OOMs logged by the workers (killed ones included)")
        if ooms == 0:
            outcome.problems.append("no OOM happened")
    # a worker must ride out every fault but its own kill: Celery reports the rest as unrecoverable
    crashes = sum(p.read_text(errors="replace").count("Unrecoverable error") for p in workers.logs.glob("*.log"))
    if crashes:
        outcome.problems.append(f"{crashes} worker crash(es) (Celery 'Unrecoverable error') in the logs")
    records = {rec.id: rec for rec in client.job(job.name).records()}
    delays = kill_delays(workers.kill_log, records)
    if delays is not None:
        notes.append(delays.note())
        if delays.p99 > KILL_DELAY_P99_MAX_S:
            outcome.problems.append(f"kill delay p99 {delays.p99:.0f} s > {KILL_DELAY_P99_MAX_S:.0f} s")
    if special.check:
        outcome.problems += special.check(env, workers, records, notes)
    workers.stop_all()
    client.close()
    return Run(name, outcome, wall, notes, delays)


def table(runs: list[Run]) -> str:
    lines = ["| scenario | images | done | failed (by type) | lost | duplicated | problems | wall s | notes |",
             "|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for run in runs:
        o = run.outcome
        failed = ", ".join(f"{k} {v}" for k, v in sorted(o.failed.items())) or "0"
        lines.append(f"| {run.name} | {o.images} | {o.done} | {failed} | {o.lost} | {o.duplicated} |"
                     f" {len(o.problems)} | {run.wall_s:.0f} | {'; '.join(run.notes)} |")
    return "\n".join(lines)


def as_json(run: Run) -> dict[str, Any]:
    o = run.outcome
    return {"scenario": run.name, "images": o.images, "done": o.done, "failed": dict(o.failed), "lost": o.lost,
            "duplicated": o.duplicated, "problems": o.problems, "wall_s": round(run.wall_s, 1), "notes": run.notes,
            "kill_delay_s": None if run.kill_delays is None else {
                "images": run.kill_delays.images, "p50": round(run.kill_delays.p50, 1),
                "p99": round(run.kill_delays.p99, 1), "max": round(run.kill_delays.max, 1)}}


def report(run: Run) -> None:
    print(f"{run.name}: {run.outcome.done} done, {dict(run.outcome.failed)} failed, lost {run.outcome.lost},"
          f" problems {run.outcome.problems[:5]} ({run.wall_s:.0f}s; {'; '.join(run.notes)})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--images", type=int, default=None)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the runs here (JSON)")
    args = parser.parse_args(argv)
    n = args.images or 2000
    down = 10.0 if args.quick else 30.0
    scenarios: list[tuple[str, dict[str, Any], Fault]] = [
        ("kill", {"image_latency_s": 0.01}, kill_fault(5.0 if args.quick else 15.0)),
        ("redis", {"image_latency_s": 0.01}, redis_fault((5.0, 12.0))),
        ("redis-crash", {"image_latency_s": 0.01}, redis_crash_fault(((0.3, 1.0), (8.0, 0.0)))),
        ("s3", {"image_latency_s": 0.01}, s3_fault(3.0, down)),
        # seed None: with one fixed seed every fresh worker's first OOM fell on its 18th batch,
        # and in 'all' (10 kills) no worker process lived that long once (CI, 2026-12-02)
        ("oom", {"image_latency_s": 0.01, "oom_rate": 0.1, "seed": None}, no_fault),
        ("all", {"image_latency_s": 0.01, "oom_rate": 0.1, "seed": None},
         together(kill_fault(6.0 if args.quick else 20.0), redis_fault((4.0, 15.0)), s3_fault(8.0, down))),
        ("decoder", {"image_latency_s": 0.01}, no_fault),
    ]
    # the full form holds Redis full 60 s, over the job's end (it must end then, and be exported)
    full_fault, full_special = redis_full(3.0, 10.0 if args.quick else 60.0, require_end=not args.quick)
    scenarios.append(("redis-full", {"image_latency_s": 0.02}, full_fault))
    specials = {"decoder": poison_special(),
                "redis-crash": Special(resubmit_after_s=30.0 if args.quick else 150.0),
                "redis-full": full_special}
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    root = Path(tempfile.mkdtemp(prefix="ocrq-chaos-"))
    from moto.server import ThreadedMotoServer

    moto_port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=moto_port, verbose=False)
    moto.start()
    proxy = CuttableProxy(moto_port)
    proxy.restore()
    bucket = "chaos"
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{moto_port}", region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    server = RedisServer(root / "redis")
    server.start()
    images = root / "images"
    word_images(images, n)
    env = Env(root, server, proxy, bucket, images, args.quick)
    runs: list[Run] = []
    try:
        for name, sim, fault in scenarios:
            if args.only and name not in args.only:
                continue
            run = run_scenario(env, name, n, sim, fault, timeout_s=max(300.0, n * 0.5),
                               special=specials.get(name))
            runs.append(run)
            report(run)
        if not args.only or "failover" in args.only:
            outcome, wall, notes = run_failover(env, n, {"image_latency_s": 0.01}, worker_env, client_for,
                                                timeout_s=max(300.0, n * 0.5))
            runs.append(run := Run("failover", outcome, wall, notes))
            report(run)
        if not args.only or "webhooks" in args.only:
            outcome, wall, notes = run_webhooks(env, n, {"image_latency_s": 0.01}, worker_env, client_for,
                                                timeout_s=max(300.0, n * 0.3))
            runs.append(run := Run("webhooks", outcome, wall, notes))
            report(run)
    finally:
        server.stop()
    try:
        if not args.only or "security" in args.only:
            t0 = time.monotonic()
            outcome, notes = run_security(root, images, moto_port, min(n, 300) if args.quick else n)
            runs.append(run := Run("security", outcome, time.monotonic() - t0, notes))
            report(run)
    finally:
        moto.stop()
    print(table(runs))
    if args.json:
        args.json.write_text(json.dumps([as_json(r) for r in runs], indent=2))
    bad = [r for r in runs if not r.outcome.ok]
    if bad:
        print(f"FAILED: {', '.join(r.name for r in bad)} (logs under {root})", file=sys.stderr)
        return 1
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
