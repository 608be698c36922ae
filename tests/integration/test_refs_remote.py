"""ocrq.refs against real services: moto's S3 HTTP server and a local http.server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import boto3
import pytest
from botocore.config import Config

from ocrq.errors import MissingObject, RefusedRef, StorageUnavailable, TooLarge
from ocrq.net.fetch import fetch
from ocrq.refs import BAD_REF_PREFIX
from ocrq.settings import LimitSettings
from producer.expand import expand, expand_entries
from tests.conftest import free_port

pytestmark = pytest.mark.integration

LIMITS = LimitSettings(max_bytes=1000, http_timeout=5.0, http_max_redirects=3, http_allow_private=True)
PAYLOAD = b"\x89PNG fake image bytes"


# --- S3 (moto server) --------------------------------------------------------------------------

def test_s3_fetch_and_errors(s3_bucket: tuple[Any, str]) -> None:
    client, bucket = s3_bucket
    client.put_object(Bucket=bucket, Key="dir/a.png", Body=PAYLOAD)
    client.put_object(Bucket=bucket, Key="dir/big.png", Body=b"x" * 1001)
    client.put_object(Bucket=bucket, Key="dir/exact.png", Body=b"x" * 1000)
    assert fetch(f"s3://{bucket}/dir/a.png", LIMITS, client) == PAYLOAD
    assert len(fetch(f"s3://{bucket}/dir/exact.png", LIMITS, client)) == 1000
    with pytest.raises(TooLarge):
        fetch(f"s3://{bucket}/dir/big.png", LIMITS, client)
    with pytest.raises(MissingObject):
        fetch(f"s3://{bucket}/dir/missing.png", LIMITS, client)
    with pytest.raises(MissingObject):
        fetch("s3://no-such-bucket-ocrq/a.png", LIMITS, client)


def test_s3_prefix_listing_paginates(s3_bucket: tuple[Any, str]) -> None:
    client, bucket = s3_bucket
    keys = [f"scan/{i:05d}.png" for i in range(1100)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: client.put_object(Bucket=bucket, Key=k, Body=b"x"), keys))
    for other in ("scan/readme.txt", "scan/", "scanner/x.png", "other/y.png", "scan/.cache/t.png",
                  "scan/list.jsonl"):
        client.put_object(Bucket=bucket, Key=other, Body=b"x")
    entries = list(expand_entries([f"s3://{bucket}/scan/"], LIMITS, client))
    # every object under the prefix, whatever its name (> 1000: a second page was read); the
    # "scan/" folder marker is not an object; hidden keys and manifests are skipped, with reasons
    assert [e.value for e in entries if e.kind == "ref"] == [f"s3://{bucket}/{k}" for k in keys + ["scan/readme.txt"]]
    assert [(e.value, e.reason) for e in entries if e.kind == "skipped"] == [
        (f"s3://{bucket}/scan/.cache/t.png", "hidden"),
        (f"s3://{bucket}/scan/list.jsonl", "a manifest inside a prefix (pass it by name to expand it)")]
    with pytest.raises(MissingObject):
        list(expand(["s3://no-such-bucket-ocrq/scan/"], LIMITS, client))


def test_s3_manifest_resolves_relative_entries(s3_bucket: tuple[Any, str]) -> None:
    client, bucket = s3_bucket
    lines = [json.dumps({"ref": "pages/p1.png"}), json.dumps("https://example.com/x.png"),
             json.dumps({"other": 1}), json.dumps("sub/")]
    client.put_object(Bucket=bucket, Key="jobs/m.jsonl", Body="\n".join(lines).encode())
    client.put_object(Bucket=bucket, Key="jobs/sub/s.jpg", Body=b"x")
    client.put_object(Bucket=bucket, Key="jobs/list.csv", Body=b"path\r\nq.png\r\n")
    got = list(expand([f"s3://{bucket}/jobs/m.jsonl", f"s3://{bucket}/jobs/list.csv"], LIMITS, client))
    assert got == [
        f"s3://{bucket}/jobs/pages/p1.png", "https://example.com/x.png",
        f"{BAD_REF_PREFIX}no reference on line 3 of s3://{bucket}/jobs/m.jsonl",
        f"s3://{bucket}/jobs/sub/s.jpg", f"s3://{bucket}/jobs/q.png",
    ]
    with pytest.raises(MissingObject):
        list(expand([f"s3://{bucket}/jobs/absent.jsonl"], LIMITS, client))


def test_s3_unreachable_is_retryable() -> None:
    client = boto3.client(
        "s3", endpoint_url=f"http://127.0.0.1:{free_port()}", region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
        config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=1),
    )
    with pytest.raises(StorageUnavailable):
        fetch("s3://b/a.png", LIMITS, client)
    with pytest.raises(StorageUnavailable):
        list(expand(["s3://b/prefix/"], LIMITS, client))


# --- HTTP (a real ThreadingHTTPServer) ---------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              length: bool = True) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if length:
            self.send_header("Content-Length", str(len(body)))
        else:
            self.send_header("Connection", "close")  # body delimited by closing the socket
        self.end_headers()
        self.wfile.write(body)

    def _trickle(self, headers: bool) -> None:
        """One byte every 0.3 s: of the status line and headers, or of a body without a length."""
        head = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nConnection: close\r\n"
        if headers:
            chunks = [head[i:i + 1] for i in range(len(head))] + [b"\r\n", PAYLOAD]
        else:
            chunks = [head + b"\r\n"] + [PAYLOAD[i:i + 1] for i in range(len(PAYLOAD))]
        for chunk in chunks:
            self.wfile.write(chunk)
            time.sleep(0.3)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path
        if path == "/img.png":
            self._send(200, PAYLOAD, {"Content-Type": "image/png"})
        elif path.startswith("/status/"):
            self._send(int(path.rsplit("/", 1)[1]), b"nope")
        elif path.startswith("/hops/"):  # /hops/N redirects N more times, then serves the image
            left = int(path.rsplit("/", 1)[1])
            if left:
                self._send(302, headers={"Location": f"/hops/{left - 1}"})
            else:
                self._send(200, PAYLOAD)
        elif path.startswith("/to?"):
            self._send(302, headers={"Location": path[len("/to?"):]})
        elif path == "/big-declared":
            self._send(200, b"x" * 1001)
        elif path == "/big-undeclared":
            self.close_connection = True
            self._send(200, b"x" * 5000, length=False)
        elif path == "/slow":
            time.sleep(1.5)
            self._send(200, PAYLOAD)
        elif path.startswith("/trickle/"):
            self._trickle(headers=path.endswith("/headers"))
        elif path == "/short":  # promises 100 bytes, sends 10, closes
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b"x" * 10)
            self.close_connection = True
        elif path == "/drip":  # every read is quick, the whole response is not
            self.send_response(200)
            self.send_header("Content-Length", "40")
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        else:
            self._send(404)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that give up early (timeouts, caps) break the pipe: expected here


@pytest.fixture(scope="module")
def http_base() -> Iterator[str]:
    server = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_ok_and_statuses(http_base: str) -> None:
    assert fetch(f"{http_base}/img.png", LIMITS) == PAYLOAD
    with pytest.raises(MissingObject):
        fetch(f"{http_base}/status/404", LIMITS)
    with pytest.raises(MissingObject):
        fetch(f"{http_base}/status/410", LIMITS)
    with pytest.raises(RefusedRef):
        fetch(f"{http_base}/status/403", LIMITS)
    for status in (500, 503, 429):
        with pytest.raises(StorageUnavailable):
            fetch(f"{http_base}/status/{status}", LIMITS)


def test_http_redirects_are_bounded(http_base: str) -> None:
    assert fetch(f"{http_base}/hops/3", LIMITS) == PAYLOAD  # exactly the limit
    with pytest.raises(RefusedRef, match="more than 3 redirects"):
        fetch(f"{http_base}/hops/4", LIMITS)
    with pytest.raises(RefusedRef):
        fetch(f"{http_base}/hops/1", LimitSettings(http_max_redirects=0, http_allow_private=True))


@pytest.mark.parametrize("target", ["file:///etc/passwd", "ftp://127.0.0.1/x.png", "s3://b/k.png"])
def test_http_redirect_to_refused_scheme(http_base: str, target: str) -> None:
    with pytest.raises(RefusedRef):
        fetch(f"{http_base}/to?{target}", LIMITS)


def test_http_redirect_to_scheme_not_allowed(http_base: str) -> None:
    https_only = LimitSettings(allowed_schemes=["http"], http_allow_private=True)  # http allowed, https not
    with pytest.raises(RefusedRef, match="refused scheme"):
        fetch(f"{http_base}/to?https://127.0.0.1:1/x.png", https_only)


def test_http_byte_cap(http_base: str) -> None:
    with pytest.raises(TooLarge):
        fetch(f"{http_base}/big-declared", LIMITS)
    with pytest.raises(TooLarge):
        fetch(f"{http_base}/big-undeclared", LIMITS)


def test_http_timeouts_are_retryable(http_base: str) -> None:
    quick = LimitSettings(http_timeout=0.5, http_allow_private=True)
    with pytest.raises(StorageUnavailable):
        fetch(f"{http_base}/slow", quick)
    started = time.monotonic()
    with pytest.raises(StorageUnavailable):
        fetch(f"{http_base}/drip", quick)
    assert time.monotonic() - started < 1.5  # the total deadline, not 40 quick reads


@pytest.mark.parametrize("part", ["headers", "body"])
def test_one_deadline_bounds_a_whole_fetch_against_a_server_that_trickles(http_base: str, part: str) -> None:
    """A real server sending one byte every 0.3 s, well inside each socket timeout: the fetch
    ends at http_timeout (1 s), retryable, and never returns the bytes it had as an image."""
    limits = LimitSettings(http_timeout=1.0, http_allow_private=True)
    started = time.monotonic()
    with pytest.raises(StorageUnavailable, match="within http_timeout"):
        fetch(f"{http_base}/trickle/{part}", limits)
    assert time.monotonic() - started < 1.8


def test_a_body_shorter_than_its_content_length_is_not_an_image(http_base: str) -> None:
    with pytest.raises(StorageUnavailable, match="short of its Content-Length"):
        fetch(f"{http_base}/short", LIMITS)


def test_http_connection_refused_is_retryable() -> None:
    with pytest.raises(StorageUnavailable):
        fetch(f"http://127.0.0.1:{free_port()}/x.png", LIMITS)


def test_private_addresses_are_refused_unless_allowed(http_base: str) -> None:
    # loopback stands in for cloud metadata / internal services: refused before connecting
    with pytest.raises(RefusedRef, match="non-public"):
        fetch(f"{http_base}/img.png", LimitSettings())
    with pytest.raises(RefusedRef, match="non-public"):
        fetch("http://169.254.169.254/latest/meta-data/", LimitSettings())
    assert fetch(f"{http_base}/img.png", LIMITS)
