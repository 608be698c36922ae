"""Chaos scenario ``webhooks``: every job's terminal event reaches its receiver, signed, through
kills and a receiver that is down.

Jobs of the suite's images are submitted through two ``ocrq serve`` replicas (alternately, each
with an ``Idempotency-Key``: a request a killed replica dropped is sent again to the other), each
job naming a webhook URL. Meanwhile one replica is SIGKILLed every few seconds and started again,
a worker is SIGKILLed and started again, and the receiver (a real HTTP server verifying every
signature with the ``standardwebhooks`` package) is down for the first 60 s (20 s in --quick),
then up. Checked: every job final with no image lost (bench.chaos.verify), and every job's
terminal event delivered to the receiver, verified, of the right type, its outbox empty.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from api.tenants import create_token
from bench.chaos.stack import Workers
from bench.chaos.verify import Outcome, verify
from ocrq import keys, names
from tests.integration.api_support import Api, Receiver, start_api

#: jobs in the scenario (each a share of the suite's images)
JOBS = 20
#: seconds between the kills of an API replica, and of a worker
API_KILL_S = 7.0
WORKER_KILL_S = 11.0


def run_webhooks(env: Any, n: int, sim: dict[str, Any], worker_env: Callable[..., dict[str, str]],
                 client_for: Callable[[Any], Any], timeout_s: float) -> tuple[Outcome, float, list[str]]:
    logs = env.root / "logs" / "webhooks"
    logs.mkdir(parents=True, exist_ok=True)
    tenants_file = env.root / "webhooks-tenants.json"
    token, secret = create_token(tenants_file, "chaos", "chaos")
    assert secret is not None
    down_s = 20.0 if env.quick else 60.0
    extra = {"OCRQ_API__TENANTS_FILE": str(tenants_file),
             "OCRQ_API__TENANTS": json.dumps({"chaos": {"allowed_schemes": ["file"],
                                                        "allowed_roots": [str(env.images)],
                                                        "requests_per_s": 10_000}}),
             "OCRQ_API__WEBHOOK_ALLOW_HOSTS": '["127.0.0.1"]', "OCRQ_API__WEBHOOK_TIMEOUT_S": "2",
             # retries spanning the receiver's outage and the kills (production: ~27 h)
             "OCRQ_API__WEBHOOK_RETRY_S": json.dumps([1, 2, 4, 8, 15, 15, 15, 15, 15, 15, 15])}
    env_vars = worker_env(env, sim, extra)
    client = client_for(env)
    client.redis.flushdb()
    receiver = Receiver({"chaos": secret})
    workers = Workers(env_vars, logs, env.redis.url, n=2)
    workers.start_all()
    apis = [start_api(env_vars, logs, f"api-{i}") for i in range(2)]
    notes: list[str] = []
    t0 = time.monotonic()
    images = sorted(env.images.iterdir())[:n]
    per = max(1, len(images) // JOBS)
    jobs = [f"wh-{i:02d}" for i in range(JOBS)]
    stop = threading.Event()
    kills = {"api": 0, "worker": 0}
    chaos = threading.Thread(target=_faults, args=(apis, env_vars, logs, workers, stop, kills), daemon=True)
    chaos.start()
    for i, job in enumerate(jobs):
        body = {"refs": [str(p) for p in images[i * per:(i + 1) * per]], "name": job, "webhook_url": receiver.url}
        _create(apis, i, token, body)
    threading.Timer(down_s, receiver.start).start()
    deadline = t0 + timeout_s
    want = {names.qualify("chaos", j) for j in jobs}
    while time.monotonic() < deadline:
        got = {names.qualify("chaos", r["body"]["data"]["id"]) for r in receiver.delivered()}
        if got >= want and not client.redis.hlen(keys.EVENTS):
            break
        time.sleep(1.0)
    stop.set()
    chaos.join(30)
    wall = time.monotonic() - t0
    outcome = _check(client, receiver, jobs, images, per, notes)
    attempts = max((len(client.redis.lrange(keys.job_deliveries(names.qualify("chaos", j)), 0, -1)) for j in jobs),
                   default=0)
    notes.append(f"receiver down the first {down_s:.0f} s; {kills['api']} API and {kills['worker']} worker kills "
                 f"(-9); {len(receiver.delivered())} of {len(jobs)} events delivered, at most {attempts} attempts "
                 "for one")
    for api in apis:
        _kill(api)
    workers.stop_all()
    receiver.stop()
    client.close()
    return outcome, wall, notes


def _create(apis: list[Api], i: int, token: str, body: dict[str, Any]) -> None:
    """POST the job to the replicas in turn until one answers (the key makes a retry the same job)."""
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": body["name"]}
    for attempt in range(60):
        api = apis[(i + attempt) % len(apis)]
        try:
            answer = httpx.post(f"{api.url}/v1/jobs", json=body, headers=headers, timeout=60)
            if answer.status_code in (200, 201):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no replica made job {body['name']}")


def _faults(apis: list[Api], env: dict[str, str], logs: Path, workers: Workers, stop: threading.Event,
            kills: dict[str, int]) -> None:
    rng = random.Random(11)
    last_worker = time.monotonic()
    while not stop.wait(API_KILL_S):
        at = rng.randrange(len(apis))
        port = int(apis[at].url.rsplit(":", 1)[1])
        _kill(apis[at])
        kills["api"] += 1
        apis[at] = start_api(env, logs, f"api-{at}-{kills['api']}", port=port)
        if time.monotonic() - last_worker >= WORKER_KILL_S:
            workers.start(workers.kill_random(rng))
            kills["worker"] += 1
            last_worker = time.monotonic()


def _kill(api: Api) -> None:
    if api.proc.poll() is None:
        os.killpg(api.proc.pid, signal.SIGKILL)
        api.proc.wait(10)


def _check(client: Any, receiver: Receiver, jobs: list[str], images: list[Path], per: int,
           notes: list[str]) -> Outcome:
    total = Outcome(images=0)
    delivered = {r["body"]["data"]["id"]: r for r in receiver.delivered()}
    for i, job in enumerate(jobs):
        qualified = names.qualify("chaos", job)
        ids = {keys.image_id(qualified, str(p)) for p in images[i * per:(i + 1) * per]}
        one = verify(client.redis, client.index, client.store, qualified, ids, client.settings.queue.name)
        total.images += one.images
        total.done += one.done
        total.failed.update(one.failed)
        total.lost += one.lost
        total.duplicated += one.duplicated
        total.problems += [f"{job}: {p}" for p in one.problems]
        event = delivered.get(job)
        if event is None:
            total.problems.append(f"{job}: its terminal event was never delivered")
        elif event["tenant"] != "chaos" or event["body"]["type"] != "job.completed":
            total.problems.append(f"{job}: delivered {event['body']['type']} for tenant {event['tenant']}")
    pending = client.redis.hlen(keys.EVENTS)
    if pending:
        total.problems.append(f"{pending} events still in the outbox")
    return total
