"""schemathesis against the live schema of a real ``ocrq serve``: generated requests to every
operation (valid and invalid), with a tenant's token; no answer may be a 5xx, and every answer
must match the schema (status code, content type, headers, body)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.fixtures.images import word_images
from tests.integration.api_support import api_factory, tokens, wait_for  # noqa: F401 - fixture
from tests.integration.conftest import worker_env

pytestmark = pytest.mark.integration

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "response_headers_conformance")


def test_no_5xx_and_every_answer_matches_the_schema(redis_url, redis_client, start_worker, api_factory,  # noqa: F811
                                                    tmp_path: Path):
    word_images(tmp_path / "img", 3)
    keys = tokens(tmp_path / "tenants.json", "acme")
    tenants = {"acme": {"allowed_schemes": ["file"], "allowed_roots": [str(tmp_path)], "requests_per_s": 10_000}}
    env = worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_ENGINE__KIND="simulated",
                     OCRQ_API__TENANTS_FILE=str(tmp_path / "tenants.json"), OCRQ_API__TENANTS=json.dumps(tenants),
                     OCRQ_API__DELIVER_WEBHOOKS="false")
    start_worker(env, name="fuzz")
    api = api_factory(env)
    token = keys["acme"][0]
    # a job and a file exist, so the generated ids sometimes meet real ones
    acme = api.client(token)
    assert acme.post("/v1/jobs", json={"refs": [str(tmp_path / "img")], "name": "known"}).status_code == 201
    wait_for(lambda: acme.get("/v1/jobs/known").json()["state"] == "succeeded", what="the known job")
    # /docs loads from files the package ships (no CDN)
    page = httpx.get(f"{api.url}/docs").text
    assert "/docs-assets/swagger-ui-bundle.js" in page and "cdn" not in page.lower()
    assert httpx.get(f"{api.url}/docs-assets/swagger-ui-bundle.js").status_code == 200
    schema = httpx.get(f"{api.url}/openapi.json").json()
    assert schema["openapi"].startswith("3.1") and "/v1/jobs" in schema["paths"] and "/v1/batches" in schema["paths"]
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
    run = subprocess.run(
        [cli, "run", f"{api.url}/openapi.json", "--url", api.url, "-H", f"Authorization: Bearer {token}",
         "--checks", CHECKS, "--max-examples", "25", "--generation-deterministic", "--request-timeout", "30",
         "--suppress-health-check", "all", "--workers", "1"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
