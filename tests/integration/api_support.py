"""A real ``ocrq serve`` process on a free port, its tenants' tokens, and a real webhook receiver
(an HTTP server on a free port that verifies every delivery with the ``standardwebhooks``
package), for the API's integration tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from api.tenants import create_token
from ocrq_cli.embedded.stack import stop_group
from tests.conftest import free_port


@dataclass
class Api:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str]

    def client(self, token: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


def tokens(tenants_file: Path, *tenants: str) -> dict[str, tuple[str, str]]:
    """A token and the webhook secret of each tenant, written to ``tenants_file``."""
    out = {}
    for tenant in tenants:
        token, secret = create_token(tenants_file, tenant, "test")
        assert secret is not None
        out[tenant] = (token, secret)
    return out


def start_api(env: dict[str, str], tmp_path: Path, name: str = "api", port: int | None = None) -> Api:
    port = port or free_port()
    log = tmp_path / f"{name}.log"
    proc = subprocess.Popen([sys.executable, "-m", "ocrq_cli", "serve", "--port", str(port)],
                            env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"ocrq serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return Api(url, proc, log, env)


@pytest.fixture()
def api_factory(tmp_path: Path) -> Iterator[Callable[..., Api]]:
    started: list[Api] = []

    def factory(env: dict[str, str], name: str = "api", port: int | None = None) -> Api:
        api = start_api(env, tmp_path, name, port)
        started.append(api)
        return api

    yield factory
    for api in started:
        if api.proc.poll() is None:
            stop_group(api.proc, 15)
        print(f"--- {api.log.name} (tail) ---\n" + api.log.read_text(errors="replace")[-3000:])


def kill9(api: Api) -> None:
    os.killpg(api.proc.pid, signal.SIGKILL)
    api.proc.wait(10)


@dataclass
class Receiver:
    """Webhook deliveries received, each verified against the tenant's secret."""

    secrets: dict[str, str]
    port: int = field(default_factory=free_port)
    received: list[dict[str, Any]] = field(default_factory=list)
    #: the job id of each request as it arrives (before any answer)
    arrived: list[str] = field(default_factory=list)
    #: what the next requests answer (popped in order; then 200)
    answers: list[int | float] = field(default_factory=list)
    down: bool = False
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> Receiver:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.arrived.append(json.loads(body).get("data", {}).get("id", ""))
                answer = outer.answers.pop(0) if outer.answers else 200
                if isinstance(answer, float):  # a receiver that hangs this long, then answers 200
                    time.sleep(answer)
                    answer = 200
                headers = {k.lower(): v for k, v in self.headers.items()}
                verified = None
                for tenant, secret in outer.secrets.items():
                    try:
                        Webhook(secret).verify(body, headers)
                        verified = tenant
                    except Exception:  # noqa: S112 - another tenant's secret
                        continue
                outer.received.append({"id": headers.get("webhook-id"), "tenant": verified, "status": answer,
                                       "body": json.loads(body)})
                self.send_response(int(answer))
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def delivered(self) -> list[dict[str, Any]]:
        """What was received with a 2xx answer, once per webhook-id."""
        seen: dict[str, dict[str, Any]] = {}
        for r in self.received:
            if 200 <= int(r["status"]) < 300:
                seen.setdefault(r["id"], r)
        return list(seen.values())


def wait_for(check: Callable[[], Any], timeout: float = 120, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.2)
