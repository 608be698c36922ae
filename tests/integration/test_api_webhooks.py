"""Webhooks as a receiver meets them: every job's terminal event (completed, failed, cancelled)
POSTed to a real HTTP server that verifies each signature with the ``standardwebhooks`` package;
retried through errors and a receiver that is down; at least once through a kill -9 of the API
in the middle of an attempt and of the worker; every attempt listed; private URLs refused."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ocrq_cli.embedded.stack import stop_group
from tests.fixtures.images import word_images
from tests.integration.api_support import Receiver, api_factory, kill9, tokens, wait_for  # noqa: F401 - fixture
from tests.integration.conftest import worker_env

pytestmark = pytest.mark.integration


def _env(redis_url: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    tenants = {"acme": {"allowed_schemes": ["file"], "allowed_roots": [str(tmp_path)]}}
    return worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_ENGINE__KIND="simulated",
                      OCRQ_API__TENANTS_FILE=str(tmp_path / "tenants.json"), OCRQ_API__TENANTS=json.dumps(tenants),
                      OCRQ_API__WEBHOOK_ALLOW_HOSTS='["127.0.0.1"]', OCRQ_API__WEBHOOK_RETRY_S="[0.5, 0.5, 1, 1, 2, 2]",
                      OCRQ_API__WEBHOOK_TIMEOUT_S="2", **extra)


def test_terminal_events_are_signed_retried_and_listed(redis_url, redis_client, start_worker, api_factory,  # noqa: F811
                                                      tmp_path: Path):
    word_images(tmp_path / "ok", 4)
    word_images(tmp_path / "bad", 2, seed=3)
    (tmp_path / "bad" / "broken.png").write_bytes(b"garbage")
    keys = tokens(tmp_path / "tenants.json", "acme")
    receiver = Receiver({"acme": keys["acme"][1]}).start()
    env = _env(redis_url, tmp_path)
    start_worker(env, name="hook")
    acme = api_factory(env).client(keys["acme"][0])

    # A private webhook URL is refused at create, unless its host is allowed (127.0.0.1 is here)
    assert acme.post("/v1/jobs", json={"refs": [str(tmp_path / "ok")], "webhook_url": "http://10.0.0.1/x"}
                     ).status_code == 422
    # the receiver answers 500 twice, then 200: the event is tried again until it lands
    receiver.answers = [500, 503]
    for name, folder in (("ok", "ok"), ("bad", "bad")):
        made = acme.post("/v1/jobs", json={"refs": [str(tmp_path / folder)], "name": name,
                                           "webhook_url": receiver.url})
        assert made.status_code == 201, made.text
    got = wait_for(lambda: len(receiver.delivered()) >= 2 and receiver.delivered(), what="two events")
    by_job = {r["body"]["data"]["id"]: r for r in got}
    assert by_job["ok"]["body"]["type"] == "job.completed" and by_job["ok"]["body"]["data"]["state"] == "succeeded"
    assert by_job["bad"]["body"]["type"] == "job.failed" and by_job["bad"]["body"]["data"]["counts"]["failed"] == 1
    assert all(r["tenant"] == "acme" for r in got), "every delivery verifies with the tenant's secret"
    attempts = [d for job in ("ok", "bad") for d in acme.get(f"/v1/jobs/{job}/deliveries").json()["data"]]
    assert len(attempts) == 4 and [a["status"] for a in attempts].count(200) == 2, attempts
    assert all(not a["url"].count("secret") for a in attempts)

    # Cancelled: job.cancelled, once
    word_images(tmp_path / "slow", 60, seed=5)
    receiver.received.clear()
    acme.post("/v1/jobs", json={"refs": [str(tmp_path / "slow")], "name": "stop", "webhook_url": receiver.url})
    acme.post("/v1/jobs/stop/cancel")
    got = wait_for(lambda: receiver.delivered(), what="the cancel event")
    assert [r["body"]["type"] for r in got] == ["job.cancelled"]


def test_at_least_once_through_kills_and_a_receiver_down(redis_url, redis_client, start_worker, api_factory,  # noqa: F811
                                                         tmp_path: Path):
    word_images(tmp_path / "a", 3)
    word_images(tmp_path / "b", 3, seed=2)
    keys = tokens(tmp_path / "tenants.json", "acme")
    receiver = Receiver({"acme": keys["acme"][1]})
    env = _env(redis_url, tmp_path)
    worker = start_worker(env, name="kill")
    api = api_factory(env, "api-1")
    acme = api.client(keys["acme"][0])

    # The receiver is down while job a finishes; the worker is killed after it finished
    acme.post("/v1/jobs", json={"refs": [str(tmp_path / "a")], "name": "a", "webhook_url": receiver.url})
    wait_for(lambda: acme.get("/v1/jobs/a").json()["state"] == "succeeded", what="job a")
    wait_for(lambda: acme.get("/v1/jobs/a/deliveries").json()["data"], what="a refused attempt")
    stop_group(worker, 0)
    # the API is killed (-9) with the event in the outbox; a new one takes over
    kill9(api)
    receiver.start()
    api2 = api_factory(env, "api-2")
    acme = api2.client(keys["acme"][0])
    got = wait_for(lambda: receiver.delivered(), what="job a's event after the restarts")
    assert [r["body"]["data"]["id"] for r in got] == ["a"]

    # An attempt in flight when the API dies (-9): the event is sent again once its claim window passes
    start_worker(env, name="kill2")
    receiver.answers = [2.5]  # the first attempt hangs past the kill
    acme.post("/v1/jobs", json={"refs": [str(tmp_path / "b")], "name": "b", "webhook_url": receiver.url})
    wait_for(lambda: "b" in receiver.arrived, what="an attempt for b", timeout=60)
    kill9(api2)
    acme = api_factory(env, "api-3").client(keys["acme"][0])
    # the new API sends it again once the dead one's claim window passed: delivered by it, the outbox empty
    done = wait_for(lambda: (d := acme.get("/v1/jobs/b/deliveries").json()) and not d["pending"] and d["data"]
                    and d, what="job b's event delivered by the new API", timeout=60)
    assert [a["delivered"] for a in done["data"]] == [True], done
    assert {r["body"]["data"]["id"] for r in receiver.delivered()} == {"a", "b"}
    time.sleep(1)
    ids = [r["id"] for r in receiver.delivered()]
    assert len(ids) == len(set(ids)) == 2, "one webhook-id per event, however often it was sent"
    receiver.stop()
