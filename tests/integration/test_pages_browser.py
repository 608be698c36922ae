"""The jobs pages as a person sees them: a real headless Chromium (Debian's `chromium`, driven by
playwright) against a real `ocrq serve`, a real `ocrq worker` (the simulated engine, slow enough
to watch) and a password-protected redis-server with a maxmemory. It signs in with a token,
watches a 300-image job submitted over the API move to its end without a reload, cancels a
second job, runs a failed image again once its file is fixed, checks another tenant's job cannot
be reached, and that no secret reaches the browser. Screenshots go to test-artifacts/pages/
(ignored by git; docs/img/ keeps one of each page)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.tenants import create_token, tenants_path
from ocrq.settings import Settings
from ocrq_cli.embedded.stack import stop_group, wait_worker_state
from tests.conftest import _need, _redis_binary, free_port
from tests.fixtures.images import render, word_images

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "pages"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PASSWORD = "redis-pw-never-shown"
JOB, DOOMED, THEIRS = "scans-2026-12", "resubmitted-by-mistake", "acme-private"


class _Hooks(BaseHTTPRequestHandler):
    received: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        self.received.append({"headers": {k.lower(): v for k, v in self.headers.items()}, "body": json.loads(body)})
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "ocrq_cli", *args], env=env, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = _redis_binary() or _need("redis-server")
    port = free_port()
    proc = subprocess.Popen([str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", str(tmp), "--requirepass", PASSWORD, "--maxmemory", "256mb",
                             "--maxmemory-policy", "noeviction"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"redis://:{PASSWORD}@127.0.0.1:{port}/0"


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.time() + 60
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer: {log.read_text()[-3000:]}")


def _until(check: Any, timeout: float, what: str) -> None:
    """Poll ``check()`` from here (page.wait_for_function evaluates a string, which the pages' CSP forbids)."""
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.2)


def _bar(page: Any, job: str) -> int:
    return int(page.get_attribute(f'tr[data-key="{job}"] [data-bar]', "aria-valuenow") or -1)


def _state(page: Any, job: str) -> str:
    return str(page.inner_text(f'tr[data-key="{job}"] [data-f="state"]'))


@pytest.fixture()
def fleet(tmp_path: Path) -> Any:
    """Redis (password, maxmemory), a worker, `ocrq serve`, a webhook receiver; tokens of two tenants."""
    if not shutil.which("chromium"):
        _need("chromium (apt-get install chromium; `make test` installs it)")
    redis_proc, url = _redis(tmp_path)
    _Hooks.received = []
    hooks = HTTPServer(("127.0.0.1", 0), _Hooks)
    threading.Thread(target=hooks.serve_forever, daemon=True).start()
    src = tmp_path / "scans"
    word_images(src, 299)
    (src / "broken.png").write_bytes(b"this is not an image")
    env = {**os.environ, "OCRQ_REDIS__URL": url, "OCRQ_STORE__KIND": "local", "PYTHONUNBUFFERED": "1",
           "OCRQ_STORE__PATH": str(tmp_path / "store"), "OCRQ_VAR_DIR": str(tmp_path / "var"),
           "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(tmp_path)]), "OCRQ_METRICS_PORT": "0",
           "OCRQ_ENGINE__KIND": "simulated", "OCRQ_ENGINE__EXTRA": json.dumps({"image_latency_s": 0.05}),
           "OCRQ_QUEUE__BACKOFF_BASE": "0.2",
           # chunks of 16: the worker records a chunk's images at once, so the bar moves in 16s
           "OCRQ_QUEUE__CHUNK_SIZE": "16",
           "OCRQ_API__WEBHOOK_ALLOW_HOSTS": '["127.0.0.1"]',
           "OCRQ_API__TENANTS": json.dumps({"acme": {"allowed_schemes": ["file"]}}),
           "OCRQ_API__FLOWER_URL": "http://127.0.0.1:1/flower", "OCRQ_API__PROMETHEUS_URL": "http://127.0.0.1:1/prometheus"}
    env.pop("OCRQ_CONFIG", None)
    settings = Settings(var_dir=tmp_path / "var")
    tokens, secrets = {}, {}
    for tenant in ("default", "acme"):
        tokens[tenant], secrets[tenant] = create_token(tenants_path(settings), tenant, "browser test")
    port = free_port()
    procs = [_spawn(["worker", "--concurrency", "2", "--name", "page@%h"], env, tmp_path / "worker.log"),
             _spawn(["serve", "--port", str(port)], env, tmp_path / "serve.log")]
    try:
        import socket

        wait_worker_state(url, f"page@{socket.gethostname()}", 300, lambda: procs[0].poll() is None,
                          lambda: (tmp_path / "worker.log").read_text()[-3000:])
        _wait_http(f"http://127.0.0.1:{port}/readyz", procs[1], tmp_path / "serve.log")

        class Fleet:
            pass

        f = Fleet()
        f.base, f.tokens, f.secrets, f.src, f.hooks = f"http://127.0.0.1:{port}", tokens, secrets, src, hooks
        f.hook_url = f"http://127.0.0.1:{hooks.server_address[1]}/ocrq"
        yield f
    finally:
        for proc, name in zip(procs, ("worker", "serve"), strict=True):
            stop_group(proc, 30)
            print(f"--- {name}.log (tail) ---\n" + (tmp_path / f"{name}.log").read_text(errors="replace")[-2000:])
        hooks.shutdown()
        redis_proc.terminate()
        redis_proc.wait(10)


def _api(f: Any, tenant: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, f.base + path, headers={"Authorization": f"Bearer {f.tokens[tenant]}"}, timeout=60,
                         **kw)


def test_a_person_follows_cancels_and_reprocesses_jobs_in_a_browser(fleet):
    sync_api = pytest.importorskip("playwright.sync_api")
    f = fleet
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), headless=True, args=CHROMIUM_FLAGS)
        ctx = browser.new_context(viewport={"width": 1280, "height": 860})
        page = ctx.new_page()
        seen: list[str] = []
        page.on("response", lambda r: seen.append(r.url))
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))

        # Given no sign-in: the jobs page sends the browser to sign in; signing in is a keyboard's work
        page.goto(f.base + "/")
        assert page.url == f.base + "/login?next=%2F"
        page.keyboard.type("ocrq_not-a-token")  # (the field has the focus)
        page.keyboard.press("Enter")
        page.wait_for_selector("#login-error")
        assert "not known" in page.inner_text("#login-error")
        page.fill("#token", f.tokens["default"])
        page.keyboard.press("Enter")
        page.wait_for_url(f.base + "/")
        assert "No jobs yet" in page.inner_text("main")
        cookie = next(c for c in ctx.cookies() if c["name"] == "ocrq_token")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert page.evaluate("document.cookie") == ""  # the page's scripts cannot read it
        page.keyboard.press("Tab")
        assert page.evaluate("document.activeElement.textContent") == "Skip to content"
        page.evaluate("document.activeElement.blur()")
        page.evaluate("window.__notReloaded = true")

        # When a 300-image job (one broken file) and a second job are submitted over the API
        r = _api(f, "default", "POST", "/v1/jobs", json={"refs": [str(f.src)], "name": JOB, "webhook_url": f.hook_url,
                                                         "metadata": {"pipeline": "nightly-scans"}})
        assert r.status_code == 201, r.text
        assert r.json()["counts"]["total"] == 300
        assert _api(f, "default", "POST", "/v1/jobs", json={"refs": [str(f.src)], "name": DOOMED}).status_code == 201

        # Then both show up without a reload; the first one's bar (the same element, updated in place) moves
        page.wait_for_selector(f'tr[data-key="{JOB}"]', timeout=10_000)
        page.wait_for_selector(f'tr[data-key="{DOOMED}"]', timeout=10_000)
        page.evaluate("""job => { window.__values = [];
            const bar = document.querySelector(`tr[data-key="${job}"] [data-bar]`);
            new MutationObserver(() => window.__values.push(+bar.getAttribute("aria-valuenow")))
              .observe(bar, {attributes: true, attributeFilter: ["aria-valuenow"]}); }""", JOB)
        _until(lambda: 0 < _bar(page, JOB) < 300, 60, "the bar moving")

        # and the second job is cancelled from its page, through the confirm step
        tab = ctx.new_page()
        tab.goto(f"{f.base}/jobs/{DOOMED}")
        tab.click("text=Cancel the job…")
        tab.wait_for_url(f"{f.base}/jobs/{DOOMED}/cancel")
        assert "never run" in tab.inner_text("main")
        tab.click("button:has-text('Cancel the job')")
        tab.wait_for_url(f"{f.base}/jobs/{DOOMED}?notice=cancelled")
        _until(lambda: tab.inner_text(".title-row [data-f=state]") == "cancelled", 60, "the cancelled state")
        doomed = _api(f, "default", "GET", f"/v1/jobs/{DOOMED}").json()
        assert doomed["state"] == "cancelled" and doomed["counts"]["cancelled"] >= 250, doomed["counts"]
        tab.close()
        page.screenshot(path=str(ARTIFACTS / "jobs-running.png"))  # (one running, one cancelled)

        # the first job's bar goes on to its end: every image final (one failed), no reload
        _until(lambda: _state(page, JOB) in ("partial", "failed", "succeeded"), 180, "the job's end")
        values = page.evaluate("window.__values")
        assert len({v for v in values if 0 < v < 300}) >= 3 and values[-1] == 300, values
        assert values == sorted(values), values
        assert _state(page, JOB) == "partial" and page.evaluate("window.__notReloaded") is True
        assert _state(page, DOOMED) == "cancelled" and not page.is_visible("[data-empty]")
        page.screenshot(path=str(ARTIFACTS / "jobs.png"))

        # The job's page: counts, plots, the failure by type with its file, the export, the webhook delivered
        page.goto(f"{f.base}/jobs/{JOB}")
        assert page.inner_text('[data-f="failed"]') == "1" and page.inner_text('[data-f="done"]') == "299"
        assert page.locator("#chart-rate svg rect.bar-rect").count() >= 1
        assert page.locator("#chart-done svg path.line").count() == 1
        failures = page.inner_text("#failures")
        assert "BadImage" in failures and "broken.png" in failures
        assert "written" in page.inner_text("#export") and "nightly-scans" in page.inner_text("main")
        # (the page fetches its webhook section again by itself)
        _until(lambda: "delivered" in page.inner_text("#deliveries"), 30, "the webhook delivered")
        assert "job.failed" in page.inner_text("#deliveries") and "HTTP 204" in page.inner_text("#deliveries")
        (hook,) = _Hooks.received
        assert hook["body"]["type"] == "job.failed" and hook["headers"]["webhook-signature"].startswith("v1,")
        page.screenshot(path=str(ARTIFACTS / "job.png"), full_page=True)

        # a POST without the page's CSRF token is refused
        assert page.request.post(f"{f.base}/jobs/{JOB}/reprocess", form={"error": "BadImage"}).status == 403

        # When the broken file is fixed and its failure run again (confirm step)
        render(f.src / "broken.png", ["fixed since", "now readable"])
        page.click("#failures a:has-text('Run again')")
        page.wait_for_url(f"{f.base}/jobs/{JOB}/reprocess?error=BadImage")
        assert "BadImage" in page.inner_text("main")
        page.click("button:has-text('Run them again')")
        page.wait_for_url(f"{f.base}/jobs/{JOB}?notice=reprocessed&n=1")
        assert "1 image(s) queued again" in page.inner_text("main")
        # Then the page follows it to success by itself
        _until(lambda: page.inner_text(".title-row [data-f=state]") == "succeeded", 60, "the job succeeded")
        _until(lambda: "No image failed" in page.inner_text("#failures"), 30, "the failures section again")
        assert page.inner_text('[data-f="done"]') == "300"
        assert _api(f, "default", "GET", f"/v1/jobs/{JOB}").json()["counts"]["failed"] == 0

        # The fleet: the worker, its engine, the queue and the broker's memory against its maxmemory
        page.goto(f"{f.base}/fleet")
        row = page.locator('[data-workers] article', has_text="page@").inner_text()
        assert "simulated" in row and "CPU (no GPU)" in row
        assert "of 256.0 MiB" in page.inner_text("main") and page.locator("#broker-meter").count() == 1
        assert page.locator("a:has-text('Flower')").get_attribute("href") == "http://127.0.0.1:1/flower"
        page.screenshot(path=str(ARTIFACTS / "fleet.png"), full_page=True)

        # Another tenant's job is not reachable from this sign-in, by page, JSON, API or action
        r = _api(f, "acme", "POST", "/v1/jobs", json={"refs": [str(f.src / "img_000.png")], "name": THEIRS})
        assert r.status_code == 201, r.text
        csrf = page.get_attribute("input[name=csrf]", "value")
        page.goto(f"{f.base}/jobs/{THEIRS}")
        assert page.inner_text("h1") == "Not found"
        assert page.request.get(f"{f.base}/live/jobs/{THEIRS}").status == 404
        assert page.request.get(f"{f.base}/v1/jobs/{THEIRS}").status == 404  # (the API reads the cookie too)
        assert page.request.post(f"{f.base}/jobs/{THEIRS}/cancel", form={"csrf": csrf}).status == 404
        page.goto(f.base + "/")
        assert THEIRS not in page.inner_text("main")
        assert _api(f, "acme", "GET", f"/v1/jobs/{THEIRS}").json()["cancelled_at"] is None

        # Every page: its language, one h1, a label on every control, a name and a sentence on every bar
        for path in ("/", f"/jobs/{JOB}", f"/jobs/{JOB}/reprocess", "/fleet"):
            page.goto(f.base + path)
            assert page.evaluate("""() => document.documentElement.lang === "en"
                && document.querySelectorAll("h1").length === 1
                && [...document.querySelectorAll("input:not([type=hidden]), select, textarea, button")]
                     .every(e => e.labels.length || e.getAttribute("aria-label") || e.textContent.trim())
                && [...document.querySelectorAll("[role=progressbar]")]
                     .every(b => b.getAttribute("aria-label") && b.getAttribute("aria-valuetext"))
                && [...document.querySelectorAll("a")].every(a => a.textContent.trim())"""), path

        # On a phone: one column, nothing wider than the screen
        phone = browser.new_context(viewport={"width": 390, "height": 844}, storage_state=ctx.storage_state(),
                                    is_mobile=True, has_touch=True)
        small = phone.new_page()
        for path in ("/", f"/jobs/{JOB}", "/fleet"):
            small.goto(f.base + path)
            small.wait_for_timeout(500)
            assert small.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"), path
        small.goto(f.base + "/")
        small.screenshot(path=str(ARTIFACTS / "jobs-phone.png"), full_page=True)
        phone.close()

        # No secret anywhere the browser was: not a token, a webhook secret, Redis's password
        secrets = [*f.tokens.values(), *(s for s in f.secrets.values() if s), PASSWORD, "X-Amz-Signature"]
        texts = [page.content()]
        for url in sorted({u for u in seen if u.startswith(f.base)}):
            texts.append(page.request.get(url).text())
        for text in texts:
            for secret in secrets:
                assert secret not in text
        assert not errors, errors

        # Signing out clears the sign-in
        page.click("button:has-text('Sign out')")
        page.wait_for_url(f.base + "/login")
        page.goto(f"{f.base}/jobs/{JOB}")
        assert page.url.startswith(f.base + "/login?next=")
        browser.close()
