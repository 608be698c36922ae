"""The jobs API as a client meets it, against a real ``ocrq serve`` on a free port, a real worker
and Redis: auth, tenants kept apart, create from refs and from an uploaded manifest, refused refs
(nothing published), idempotent retries, results paged, export files, failed and reprocess,
cancel, request and in-flight limits; and two replicas answering alternately."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from producer.client import Client
from tests.fixtures.images import word_images
from tests.integration.api_support import Api, api_factory, tokens, wait_for  # noqa: F401 - fixture
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration


def _env(redis_url: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    tenants = {"acme": {"allowed_schemes": ["file"], "allowed_roots": [str(tmp_path / "acme")]},
               "globex": {"allowed_schemes": ["file"], "allowed_roots": [str(tmp_path)]},
               "tiny": {"requests_per_s": 2, "max_in_flight": 5, "allowed_schemes": ["file"],
                        "allowed_roots": [str(tmp_path)]}}
    return worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_ENGINE__KIND="simulated",
                      OCRQ_API__TENANTS_FILE=str(tmp_path / "tenants.json"), OCRQ_API__TENANTS=json.dumps(tenants),
                      OCRQ_API__DELIVER_WEBHOOKS="false", **extra)


def _done(client: httpx.Client, job: str, states: tuple[str, ...] = ("succeeded", "partial", "failed", "cancelled")
          ) -> dict[str, Any]:
    return wait_for(lambda: (v := client.get(f"/v1/jobs/{job}").json()) and v.get("state") in states and v,
                    what=f"job {job} final")


def _lines(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def test_jobs_api_as_a_client_uses_it(redis_url, redis_client, start_worker, api_factory, tmp_path: Path):  # noqa: F811
    # Given a worker, an API, and three tenants with tokens (acme may read files under acme/ only)
    images = tmp_path / "acme" / "scans"
    word_images(images, 12)
    (images / "zz-broken.png").write_bytes(b"not an image at all")
    keys = tokens(tmp_path / "tenants.json", "acme", "globex", "default")
    env = _env(redis_url, tmp_path)
    start_worker(env, name="api")
    api: Api = api_factory(env)
    acme, globex = api.client(keys["acme"][0]), api.client(keys["globex"][0])

    # No token, or one ocrq does not know: 401
    assert api.client(None).get("/v1/jobs").status_code == 401
    assert api.client("ocrq_nope").get("/v1/jobs").json()["error"]["code"] == "unauthorized"

    # Refs outside the tenant's rules answer 422 with each ref's reason; nothing is published
    refused = acme.post("/v1/jobs", json={"refs": [str(tmp_path / "other.png"), "https://example.com/a.png"],
                                          "name": "nope"})
    assert refused.status_code == 422, refused.text
    body = refused.json()["error"]
    assert body["code"] == "refs_refused" and len(body["refused"]) == 2
    assert acme.get("/v1/jobs/nope").status_code == 404

    # Create from refs: 201, a Location, a job that ends partial (one file is not an image)
    made = acme.post("/v1/jobs", json={"refs": [str(images)], "name": "inv", "metadata": {"batch": "7"}})
    assert made.status_code == 201, made.text
    assert made.headers["location"] == "/v1/jobs/inv"
    final = _done(acme, "inv")
    assert final["state"] == "partial" and final["counts"]["done"] == 12 and final["counts"]["failed"] == 1, final
    assert final["metadata"] == {"batch": "7"} and final["export"]["written"] is True

    # Results: the same lines as `ocrq results`, paged by a cursor into one whole
    whole = _lines(acme.get("/v1/jobs/inv/results"))
    assert len(whole) == 13 and {r["status"] for r in whole} == {"done", "failed"}
    pages, after = [], 0
    while True:
        page = acme.get("/v1/jobs/inv/results", params={"after": after, "limit": 5})
        got = _lines(page)
        pages += got
        if len(got) < 5:
            break
        after = int(page.headers["ocrq-next-after"])
    assert [r["id"] for r in pages] == [r["id"] for r in whole]
    exported = acme.get("/v1/jobs/inv/export/results.jsonl")
    assert exported.status_code == 200 and len(exported.text.splitlines()) == 13

    # Failed images with their typed error; fixed, reprocessed, the job succeeds
    failed = acme.get("/v1/jobs/inv/failed").json()["data"]
    assert [f["error"]["type"] for f in failed] == ["BadImage"], failed
    (images / "zz-broken.png").write_bytes((images / "img_000.png").read_bytes())
    assert acme.post("/v1/jobs/inv/reprocess").json()["reprocessed"] == 1
    assert _done(acme, "inv", ("succeeded",))["counts"]["failed"] == 0

    # Another tenant: the job is unknown (404 everywhere), its list is empty
    for path in ("/v1/jobs/inv", "/v1/jobs/inv/results", "/v1/jobs/inv/failed", "/v1/jobs/inv/deliveries"):
        assert globex.get(path).status_code == 404, path
    assert globex.post("/v1/jobs/inv/cancel").status_code == 404
    assert globex.get("/v1/jobs").json()["data"] == []
    assert [j["id"] for j in acme.get("/v1/jobs").json()["data"]] == ["inv"]
    assert [j["id"] for j in acme.get("/v1/jobs", params={"state": "succeeded"}).json()["data"]] == ["inv"]
    assert acme.get("/v1/jobs", params={"state": "running"}).json()["data"] == []

    # match: of the files found in the folder, those whose name matches (any case); the rest skipped
    only = acme.post("/v1/jobs", json={"refs": [str(images)], "name": "some", "match": ["IMG_00?.PNG"]})
    assert only.status_code == 201, only.text
    final = _done(acme, "some")
    assert final["state"] == "succeeded" and final["counts"]["done"] == 10, final
    assert final["counts"]["skipped"] == 3 and final["counts"]["failed"] == 0, final
    bad = acme.post("/v1/jobs", json={"refs": [str(images)], "match": ["scans/*.png"]})
    assert bad.status_code == 422 and "not its path" in bad.text, bad.text

    # Idempotency-Key: the same key and body give the same job; another body with it is 409
    body1 = {"refs": [str(images / "img_001.png")]}
    first = acme.post("/v1/jobs", json=body1, headers={"Idempotency-Key": "k-1"})
    again = acme.post("/v1/jobs", json=body1, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == 201 and again.status_code == 200, (first.text, again.text)
    assert again.headers.get("idempotent-replayed") == "true" and again.json()["id"] == first.json()["id"]
    other = acme.post("/v1/jobs", json={"refs": [str(images / "img_002.png")]}, headers={"Idempotency-Key": "k-1"})
    assert other.status_code == 409 and other.json()["error"]["code"] == "conflict"
    # (the same key is another job for another tenant)
    assert globex.post("/v1/jobs", json=body1, headers={"Idempotency-Key": "k-1"}).status_code == 201

    # A manifest upload (multipart): its rows travel into the results
    manifest = "".join(json.dumps({"ref": str(images / f"img_{i:03d}.png"), "id": f"row-{i}"}) + "\n"
                       for i in range(4))
    up = acme.post("/v1/jobs", files={"manifest": ("m.jsonl", manifest.encode(), "application/jsonl")},
                   data={"options": json.dumps({"name": "from-manifest"})})
    assert up.status_code == 201, up.text
    _done(acme, "from-manifest")
    rows = sorted(r["row"]["id"] for r in _lines(acme.get("/v1/jobs/from-manifest/results")))
    assert rows == ["row-0", "row-1", "row-2", "row-3"]
    # a relative path in an uploaded manifest has no folder: refused, said
    rel = acme.post("/v1/jobs", files={"manifest": ("m.jsonl", b'{"ref": "img_000.png"}\n', "application/jsonl")})
    assert rel.status_code == 422 and "relative path" in rel.text

    # The default tenant's jobs are the CLI's and the Python client's
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))
    client.submit([str(images / "img_003.png")], job="cli-job").wait(timeout=60)
    default = api.client(keys["default"][0])
    assert default.get("/v1/jobs/cli-job").json()["state"] in ("finalizing", "succeeded")
    assert acme.get("/v1/jobs/cli-job").status_code == 404


def test_rate_and_in_flight_limits(redis_url, redis_client, start_worker, api_factory, tmp_path: Path):  # noqa: F811
    word_images(tmp_path / "in", 12)
    keys = tokens(tmp_path / "tenants.json", "tiny")
    api = api_factory(_env(redis_url, tmp_path))
    tiny = api.client(keys["tiny"][0])
    # 2 requests a second: a burst of 8 meets 429s that say when to come back
    answers = [tiny.get("/v1/jobs") for _ in range(8)]
    limited = [r for r in answers if r.status_code == 429]
    assert limited and all(1 <= int(r.headers["retry-after"]) <= 2 for r in limited)
    time.sleep(1.1)
    # 5 images in flight at most: a job of 12 is refused before anything is published
    refused = tiny.post("/v1/jobs", json={"refs": [str(tmp_path / "in")], "name": "big"})
    assert refused.status_code == 429 and "max_in_flight" in refused.text, refused.text
    time.sleep(1.1)
    assert tiny.get("/v1/jobs/big").status_code == 404


def test_two_replicas_answer_alternately(redis_url, redis_client, start_worker, api_factory, tmp_path: Path):  # noqa: F811
    # Given two API processes on one Redis and store, and every request alternating between them
    word_images(tmp_path / "acme", 30)
    keys = tokens(tmp_path / "tenants.json", "acme")
    env = _env(redis_url, tmp_path, OCRQ_ENGINE__EXTRA=json.dumps({"image_latency_s": 0.05}))
    start_worker(env, name="rep")
    a, b = api_factory(env, "api-a"), api_factory(env, "api-b")
    clients = [a.client(keys["acme"][0]), b.client(keys["acme"][0])]
    n = 0

    def call(method: str, path: str, **kw: Any) -> httpx.Response:
        nonlocal n
        n += 1
        return clients[n % 2].request(method, path, **kw)

    assert call("POST", "/v1/jobs", json={"refs": [str(tmp_path / "acme")], "name": "rep"},
                headers={"Idempotency-Key": "rep"}).status_code == 201
    assert call("POST", "/v1/jobs", json={"refs": [str(tmp_path / "acme")], "name": "rep"},
                headers={"Idempotency-Key": "rep"}).status_code == 200
    seen = []
    while (v := call("GET", "/v1/jobs/rep").json())["state"] not in ("succeeded", "partial"):
        seen.append(v["counts"]["done"])
        assert call("GET", "/v1/jobs").json()["data"][0]["id"] == "rep"
        time.sleep(0.1)
    assert seen == sorted(seen), "progress never goes back, whichever replica answers"
    assert len(_lines(call("GET", "/v1/jobs/rep/results"))) == 30
    assert len(_lines(call("GET", "/v1/jobs/rep/results", params={"after": 10}))) == 20


def test_cancel_through_the_api_mid_job_and_after_completion(redis_url, redis_client, start_worker, api_factory,  # noqa: F811
                                                            tmp_path: Path):
    word_images(tmp_path / "acme" / "a", 200)
    word_images(tmp_path / "acme" / "b", 3, seed=9)
    keys = tokens(tmp_path / "tenants.json", "acme")
    env = _env(redis_url, tmp_path, OCRQ_ENGINE__EXTRA=json.dumps({"image_latency_s": 0.03}),
               OCRQ_QUEUE__CHUNK_SIZE="8")
    start_worker(env, name="can")
    acme = api_factory(env).client(keys["acme"][0])
    assert acme.post("/v1/jobs", json={"refs": [str(tmp_path / "acme" / "a")], "name": "half"}).status_code == 201
    wait_for(lambda: acme.get("/v1/jobs/half").json()["progress"] >= 0.5, what="half done")
    after = acme.post("/v1/jobs/half/cancel").json()
    assert after["state"] in ("cancelling", "cancelled") and after["cancelled_at"]
    final = _done(acme, "half")
    assert final["state"] == "cancelled" and final["counts"]["cancelled"] > 0, final
    assert final["counts"]["done"] + final["counts"]["cancelled"] == 200
    marker = json.loads(acme.get("/v1/jobs/half/export/_SUCCESS").text)
    assert marker["cancelled"] is True
    # cancelling a job that completed changes nothing
    assert acme.post("/v1/jobs", json={"refs": [str(tmp_path / "acme" / "b")], "name": "quick"}).status_code == 201
    assert _done(acme, "quick")["state"] == "succeeded"
    assert acme.post("/v1/jobs/quick/cancel").json()["state"] == "succeeded"
