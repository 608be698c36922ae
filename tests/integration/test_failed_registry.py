"""`ocrq failed` / `ocrq reprocess` as ops run them (real CLI processes, a real worker and Redis):
filters, show, the durable mirror after Redis loses its data, purge, and reprocess keeping the
job's queue and priority."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ocrq.jobs.failed import registered
from ocrq.metrics.redis_series import queue_depth
from ocrq_cli.embedded.stack import stop_group
from producer.client import Client
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ocrq_cli", *args], env=env, capture_output=True, text=True,
                          timeout=60)


def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_failed_filters_show_store_mirror_purge_and_reprocess(redis_url, redis_client, start_worker,
                                                              tmp_path: Path):
    # Given a job on queue "side" at priority 7 with a broken image and one that vanishes after
    # submit (a missing file is refused at submit; one deleted after the plan fails on the worker)
    src = tmp_path / "in"
    word_images(src, 2)
    (src / "broken.png").write_bytes(b"definitely not a png")
    gone = tmp_path / "gone.png"
    refs = [str(p) for p in sorted(src.iterdir())] + [str(gone)]
    worker = start_worker(worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_QUEUE__NAME="side"),
                          name="reg")
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))

    def submit() -> dict[str, int]:
        gone.write_bytes((src / "img_000.png").read_bytes())
        plan = client.plan(refs)
        assert (plan.accepted, plan.refused) == (4, 0), plan.summary()
        gone.unlink()
        return client.submit(plan, job="reg", queue="side", priority=7).wait(timeout=120)

    counts = submit()
    assert counts["failed"] == 2 and counts["done"] == 2, counts
    env = {**os.environ, "OCRQ_REDIS__URL": redis_url, "OCRQ_STORE__PATH": str(tmp_path / "store")}
    env.pop("OCRQ_CONFIG", None)

    # When ops list the failures: both, with typed errors; filters narrow them
    every = _lines(_cli(env, "failed", "--job", "reg").stdout)
    assert sorted(Path(f["ref"]).name for f in every) == ["broken.png", "gone.png"]
    types = {Path(f["ref"]).name: f["error"]["type"] for f in every}
    assert types == {"broken.png": "BadImage", "gone.png": "MissingObject"}
    # a limit reads only the oldest failures (what `submit --wait` names)
    oldest = [f.record.id for f in registered(client.index, client.store, "reg")]
    assert [f.record.id for f in registered(client.index, client.store, "reg", limit=1)] == oldest[:1]
    only = _lines(_cli(env, "failed", "--error", "BadImage").stdout)
    assert [Path(f["ref"]).name for f in only] == ["broken.png"]
    assert _lines(_cli(env, "failed", "--since", "1h").stdout) == every
    assert _cli(env, "failed", "--since", "2030-01-01T00:00").stdout == ""
    assert _cli(env, "failed", "--since", "yesterday-ish").returncode == 2
    as_array = json.loads(_cli(env, "failed", "--json", "--job", "reg").stdout)
    assert as_array == every
    # show: the record, when it failed and the stored result document
    shown = json.loads(_cli(env, "failed", "show", only[0]["id"]).stdout)
    assert shown["in_registry"] and shown["record"]["error"]["type"] == "BadImage"
    assert shown["result"]["record"]["status"] == "failed"
    assert _cli(env, "failed", "show", "no-such-image").returncode == 1

    # Redis loses its data: the durable mirror still lists what failed
    redis_client.flushall()
    assert _cli(env, "failed", "--job", "reg").stdout == ""
    mirrored = _lines(_cli(env, "failed", "--from-store", "--job", "reg").stdout)
    assert sorted(Path(f["ref"]).name for f in mirrored) == ["broken.png", "gone.png"]

    # Run the job again (same ids), then reprocess keeps its queue and priority
    counts = submit()
    assert counts["failed"] == 2
    stop_group(worker, 30)  # nothing consumes "side" now: the re-published message stays visible
    dry = _cli(env, "reprocess", "--job", "reg", "--error", "BadImage", "--dry-run")
    assert dry.returncode == 0 and "would re-publish 1 image" in dry.stderr, dry.stderr
    # the dry run lists what it would re-publish: job, id, ref, why (one tab-separated line each)
    (listed,) = dry.stdout.splitlines()
    dry_job, _, dry_ref, why = listed.split("\t")
    assert dry_job == "reg" and Path(dry_ref).name == "broken.png" and why.startswith("BadImage: ")
    assert queue_depth(redis_client, "side") == 0
    done = _cli(env, "reprocess", "--job", "reg", "--error", "BadImage")
    assert done.returncode == 0 and "re-published 1" in done.stderr, done.stderr
    assert queue_depth(redis_client, "side") == 1 and queue_depth(redis_client, "ocrq") == 0
    (raw,) = [m for name in redis_client.keys("side*") for m in redis_client.lrange(name, 0, -1)]
    message = json.loads(raw)
    assert message["properties"]["priority"] == 7
    assert message["properties"]["delivery_info"]["routing_key"] == "side"
    # the reprocessed image left the registry and its mirror (a failure again writes a new one)
    assert [Path(f["ref"]).name for f in _lines(_cli(env, "failed", "--from-store").stdout)] == ["gone.png"]

    # purge forgets the rest (registry + mirror); without a filter it refuses
    assert _cli(env, "failed", "purge").returncode == 2
    purged = _cli(env, "failed", "purge", "--job", "reg", "--error", "MissingObject")
    assert purged.returncode == 0, purged.stderr
    assert [f["error"]["type"] for f in _lines(_cli(env, "failed", "--job", "reg").stdout)] == []
    assert _lines(_cli(env, "failed", "--from-store").stdout) == []
