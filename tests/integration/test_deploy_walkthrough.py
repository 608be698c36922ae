"""docs/deploy.md's two-host walkthrough, run as written: its redis.conf (a password), its env
file for both hosts, its worker and producer commands through bash, with the hosts' names and
ports swapped for local ones, moto's S3 server for MinIO and a temporary directory per host for
/srv/ocrq. Two real worker processes with different OCRQ_VAR_DIRs share one Redis and one store;
both take images; the results and the export land in S3, not on either host's disk."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from ocrq_cli.embedded.stack import stop_group
from tests.conftest import ROOT, _redis_binary, free_port
from tests.fixtures.images import word_images

pytestmark = pytest.mark.integration

DOC = ROOT / "docs" / "deploy.md"
IMAGES = 32


def blocks() -> dict[str, str]:
    """The walkthrough's blocks: the fenced block after each ``<!-- walkthrough: NAME -->``."""
    found = re.findall(r"<!-- walkthrough: (\S+) -->\n```[a-z]*\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    return dict(found)


def local(text: str, host: Path, swaps: dict[str, str]) -> str:
    """A block as it reads on ``host`` of the test: /etc/ocrq and /srv/ocrq under its directory."""
    text = text.replace("/etc/ocrq/", f"{host}/etc/").replace("/srv/ocrq", str(host))
    for old, new in swaps.items():
        text = text.replace(old, new)
    return text


def test_the_two_host_walkthrough_runs_as_written(tmp_path: Path, s3_endpoint: str) -> None:
    import boto3

    found = blocks()
    assert set(found) == {"redis.conf", "ocrq.env", "worker", "producer"}, set(found)
    port = free_port()
    swaps = {"redis.internal:6379": f"127.0.0.1:{port}", "port 6379": f"port {port}", "bind 0.0.0.0": "bind 127.0.0.1",
             "http://minio.internal:9000": s3_endpoint}
    # an `ocrq` on PATH that is this checkout's
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "ocrq").write_text(f"#!/bin/sh\nexec {sys.executable} -m ocrq_cli \"$@\"\n")
    (shim / "ocrq").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OCRQ_", "AWS_"))}
    base.update(PATH=f"{shim}:{base['PATH']}", PYTHONUNBUFFERED="1", COLUMNS="200")
    hosts = {name: tmp_path / name for name in ("host-a", "host-b", "laptop")}
    for host in hosts.values():
        (host / "etc").mkdir(parents=True)
        (host / "redis").mkdir()
    # the bucket and the scans, as the walkthrough assumes them
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="ocrq",
                      aws_secret_access_key="x")
    for bucket in ("ocrq-results", "scans-in"):
        s3.create_bucket(Bucket=bucket)
    truth = word_images(tmp_path / "scans", IMAGES, seed=11)
    for path in truth:
        s3.upload_file(str(path), "scans-in", f"batch-1/{path.name}")

    procs: list[subprocess.Popen[bytes]] = []
    try:
        # Host A: Redis from the walkthrough's redis.conf (a password, AOF, noeviction)
        conf = hosts["host-a"] / "etc" / "redis.conf"
        conf.write_text(local(found["redis.conf"], hosts["host-a"], swaps))
        procs.append(subprocess.Popen([_redis_binary() or "redis-server", str(conf)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        _wait_port(port)
        with pytest.raises(redis.AuthenticationError):  # the password is required
            redis.Redis(port=port).ping()
        # Both hosts: the env file, then the worker command, each in its own var dir and metrics port
        for name in ("host-a", "host-b"):
            host = hosts[name]
            env_swaps = {**swaps, "OCRQ_METRICS_PORT=9809": f"OCRQ_METRICS_PORT={free_port()}",
                         "gpu0@%h": f"gpu0@{name}"}
            (host / "etc" / "ocrq.env").write_text(local(found["ocrq.env"], host, env_swaps))
            log = (host / "worker.log").open("wb")
            procs.append(subprocess.Popen(["bash", "-ec", local(found["worker"], host, env_swaps)], cwd=host,
                                          env=base, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        client = redis.Redis.from_url(f"redis://:CHANGE-ME-long-random@127.0.0.1:{port}/0")
        _wait_workers(client, {"gpu0@host-a", "gpu0@host-b"}, procs, hosts)

        # Anywhere: the producer's block (chunks of 4, so that both workers get some of 32 images)
        laptop = hosts["laptop"]
        (laptop / "etc" / "ocrq.env").write_text(local(found["ocrq.env"], laptop, swaps))
        run = subprocess.run(["bash", "-ec", local(found["producer"], laptop, swaps)], cwd=laptop,
                             env={**base, "OCRQ_QUEUE__CHUNK_SIZE": "4"}, capture_output=True, text=True, timeout=600)
        print(run.stderr[-4000:], run.stdout[-2000:])
        assert run.returncode == 0, run.stderr
        status = json.loads(run.stdout.splitlines()[0])  # `ocrq status --json`
        assert (status["done"], status["failed"], status["total"]) == (IMAGES, 0, IMAGES)
        assert "results/batch-1/export/results.jsonl" in run.stderr

        # Then both workers took images, every document is in S3, and neither host kept results
        workers: dict[str, int] = {}
        lines = 0
        prefix = "ocrq/results/batch-1/parts/"
        parts = s3.get_paginator("list_objects_v2").paginate(Bucket="ocrq-results", Prefix=prefix)
        for page in parts:
            for obj in page.get("Contents", []):
                for raw in s3.get_object(Bucket="ocrq-results", Key=obj["Key"])["Body"].read().splitlines():
                    worker = json.loads(raw)["record"]["worker"]
                    workers[worker] = workers.get(worker, 0) + 1
                    lines += 1
        assert lines == IMAGES and set(workers) == {"gpu0@host-a", "gpu0@host-b"}, workers
        export = s3.get_object(Bucket="ocrq-results", Key="ocrq/results/batch-1/export/results.jsonl")["Body"].read()
        texts = {Path(x["ref"]).name: x["text"].lower() for x in map(json.loads, export.splitlines())}
        assert len(texts) == IMAGES
        assert all(word in texts[path.name] for path, words in truth.items() for word in words[:1])
        s3.head_object(Bucket="ocrq-results", Key="ocrq/results/batch-1/export/_SUCCESS")
        for name in ("host-a", "host-b"):
            assert not list(hosts[name].rglob("store.sqlite3")), name
    finally:
        for proc in reversed(procs):
            stop_group(proc, 30) if proc.args[0] == "bash" else (proc.terminate(), proc.wait(15))
        for name in ("host-a", "host-b"):
            log = hosts[name] / "worker.log"
            if log.exists():
                print(f"--- {name} worker.log (tail) ---\n" + log.read_text(errors="replace")[-2000:])
        shutil.rmtree(tmp_path / "scans", ignore_errors=True)


def _wait_port(port: int) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("redis-server did not start from the walkthrough's redis.conf")


def _wait_workers(client: Any, names: set[str], procs: list[subprocess.Popen[bytes]], hosts: dict[str, Path]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        up = {k.decode().split(":", 2)[2] for k in client.scan_iter("ocrq:workers:*")}
        if names <= up:
            return
        assert all(p.poll() is None for p in procs), "a worker exited: " + "".join(
            (hosts[n] / "worker.log").read_text(errors="replace")[-2000:] for n in ("host-a", "host-b"))
        time.sleep(0.5)
    raise AssertionError(f"workers not ready: {names}")
