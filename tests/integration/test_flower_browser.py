"""Flower as a person sees it: a real headless Chromium (Debian's `chromium`, driven by
playwright) logs in with basic auth to the Flower `ocrq flower` runs, and reads the broker,
workers and tasks pages around a job with a broken image. Screenshots are kept under
test-artifacts/flower/ (ignored by git)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path
from typing import Any

import pytest

from producer.client import Client
from tests.conftest import _need, free_port
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "flower"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
USER, PASSWORD = "ops", "browser-test-secret"


def _status(url: str, auth: tuple[str, str] | None = None) -> int:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:  # not listening yet
        return 0


def _browser(p: Any) -> Any:
    """Debian's chromium (no browser download); playwright gives it a fresh temporary profile."""
    chromium = shutil.which("chromium")
    if not chromium:
        _need("chromium (apt-get install chromium; `make test` installs it)")
    return p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)


def _row_cells(page: Any, text: str) -> list[str]:
    row = page.locator("tr", has=page.locator("td", has_text=text)).first
    return [c.strip() for c in row.locator("td").all_inner_texts()]


def test_ops_read_broker_workers_and_tasks_in_a_browser(redis_url, start_worker, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**worker_env(redis_url, tmp_path / "store", [tmp_path]), "OCRQ_FLOWER_PORT": str(port),
           "OCRQ_FLOWER_BASIC_AUTH": f"{USER}:{PASSWORD}", "OCRQ_VAR_DIR": str(tmp_path / "var")}
    log = (tmp_path / "flower.log").open("wb")
    flower = subprocess.Popen([sys.executable, "-m", "ocrq_cli", "flower", "--address", "127.0.0.1"],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 60
        while _status(base + "/healthcheck") != 200:
            assert flower.poll() is None and time.time() < deadline, (tmp_path / "flower.log").read_text()
            time.sleep(0.3)
        # Anonymous requests are refused, the page and the API answer with credentials
        assert _status(base + "/") == 401
        assert _status(base + "/api/workers") == 401
        assert _status(base + "/", (USER, PASSWORD)) == 200
        assert _status(base + "/api/queues/length", (USER, PASSWORD)) == 200

        # Given a job of 3 chunks (one with a broken image) waiting, at priority 5, no worker yet
        src = tmp_path / "in"
        word_images(src, 5)
        (src / "broken.png").write_bytes(b"not an image at all")
        client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]},
                                     queue={"chunk_size": 2}))
        job = client.submit([str(src)], job="browser", priority=5)

        with sync_api.sync_playwright() as p:
            browser = _browser(p)
            ctx = browser.new_context(http_credentials={"username": USER, "password": PASSWORD},
                                      viewport={"width": 1400, "height": 800})
            page = ctx.new_page()
            # Then the Broker page lists the ocrq queue with its 3 messages (priority level summed)
            page.goto(base + "/broker")
            page.wait_for_selector("td:text-is('ocrq')")
            assert _row_cells(page, "ocrq")[:2] == ["ocrq", "3"], _row_cells(page, "ocrq")
            page.screenshot(path=str(ARTIFACTS / "broker-backlog.png"))

            # When a worker drains it
            start_worker(worker_env(redis_url, tmp_path / "store", [tmp_path]), name="browser")
            counts = job.wait(timeout=120)
            assert counts["failed"] == 1 and counts["done"] == 5, counts
            job.wait_export(timeout=60)  # the job's export task (ocrq.finish_job) ran too

            # Then the Workers page shows it online
            page.goto(base + "/workers")
            page.wait_for_selector("text=browser@", timeout=30_000)
            cells = _row_cells(page, "browser@")
            assert any(c.lower() == "online" for c in cells), cells
            page.screenshot(path=str(ARTIFACTS / "workers.png"))

            # the Tasks page names the chunk with the broken image: FAILED in its result
            page.goto(base + "/tasks")
            page.wait_for_selector("text=FAILED 1/2: BadImage", timeout=30_000)
            page.wait_for_selector("text=ocrq.finish_job", timeout=30_000)
            texts = page.locator("tbody tr").all_inner_texts()
            chunks = [t for t in texts if "ocrq.ocr_chunk" in t]
            assert len(chunks) == 3 and all("SUCCESS" in t for t in chunks), texts
            assert sum("FAILED 1/2: BadImage" in t for t in chunks) == 1, texts
            assert sum("ok 2/2" in t for t in chunks) == 2, texts
            (export,) = [t for t in texts if "ocrq.finish_job" in t]
            assert "SUCCESS" in export, export
            page.screenshot(path=str(ARTIFACTS / "tasks.png"))

            # its task page shows the images of the chunk and the typed error of the broken one
            uuid = _row_cells(page, "FAILED 1/2")[1]
            page.goto(f"{base}/task/{uuid}")
            page.wait_for_selector("text=BadImage")
            body = page.inner_text("body")
            assert "broken.png" in body and "SUCCESS" in body
            assert "BadImage" in body and "not an image or a PDF" in body
            page.screenshot(path=str(ARTIFACTS / "task-failed-chunk.png"), full_page=True)

            # and the Broker page shows the queue drained
            page.goto(base + "/broker")
            page.wait_for_selector("td:text-is('ocrq')")
            assert _row_cells(page, "ocrq")[:2] == ["ocrq", "0"]
            browser.close()
    finally:
        os.killpg(flower.pid, 15)
        flower.wait(15)
