"""The walk a new user takes, replayed with the real command line: a fresh directory, `ocrq up`
(its own Redis, the RapidOCR worker and Flower, on free ports), a folder with images, a two-page
PDF and a corrupt file submitted with --wait (exit 3, the failure named), `ocrq failed`, the file
fixed, `ocrq reprocess --wait` (exit 0), `ocrq export --wait` (the files named), `ocrq down`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from PIL import Image

from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.integration

EXAMPLES = ROOT / "examples" / "images"


def _ocrq(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([sys.executable, "-m", "ocrq_cli", *args], cwd=cwd, env=env, text=True,
                         capture_output=True, timeout=timeout)
    print(f"$ ocrq {' '.join(args)}  → {run.returncode}\n{run.stderr[-3000:]}{run.stdout[-2000:]}")
    return run


def test_the_newcomer_walk(tmp_path: Path) -> None:
    # Given a fresh directory with a folder of scans: two images, a two-page PDF, a corrupt file
    home = tmp_path / "fresh"
    scans = home / "scans"
    scans.mkdir(parents=True)
    for name in ("invoice_en.png", "receipt_en.png"):
        (scans / name).write_bytes((EXAMPLES / name).read_bytes())
    pages = [Image.open(EXAMPLES / n).convert("RGB") for n in ("memo_gray.png", "single_line.png")]
    pages[0].save(scans / "two-pages.pdf", "PDF", save_all=True, append_images=pages[1:])
    (scans / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(200))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OCRQ_")}
    env.update(OCRQ_REDIS__URL=f"redis://127.0.0.1:{free_port()}/0", OCRQ_FLOWER_PORT=str(free_port()),
               OCRQ_API__PORT=str(free_port()),
               OCRQ_METRICS_PORT=str(free_port()), PYTHONUNBUFFERED="1", COLUMNS="200")
    up = _ocrq(["up"], home, env)
    pids: list[int] = []
    try:
        assert up.returncode == 0, up.stderr
        pids = [int(p.read_text()) for p in (home / "var" / "run").glob("*.pid")]
        assert len(pids) >= 3  # redis, the worker, flower

        # When the folder is submitted and waited for
        first = _ocrq(["submit", "scans", "--job", "first", "--wait"], home, env)
        # Then it exits 3, naming the file that failed and why, and where to go from there
        assert first.returncode == 3, first.stderr
        assert "4 accepted, 0 skipped, 0 refused" in first.stderr
        assert f"failed {scans / 'broken.png'}: BadImage" in first.stderr
        assert "`ocrq failed --job first` lists the 1 image that failed" in first.stderr
        assert "ImagesFailed: 1 of 4 images failed in job first" in first.stderr
        # and its progress went by image, with a rate (plain lines: stderr is not a terminal)
        assert "/4 images · done" in first.stderr and "img/s" in first.stderr

        # When the user lists what failed, fixes the file and reprocesses it
        failed = _ocrq(["failed", "--job", "first"], home, env)
        (line,) = [json.loads(x) for x in failed.stdout.splitlines()]
        assert line["error"]["type"] == "BadImage" and line["ref"] == str(scans / "broken.png")
        (scans / "broken.png").write_bytes((EXAMPLES / "notice_zh.png").read_bytes())
        again = _ocrq(["reprocess", "--job", "first", "--wait"], home, env)
        # Then every image is done: exit 0
        assert again.returncode == 0, again.stderr
        assert "re-published 1 image that failed" in again.stderr

        # When the export is asked for
        export = _ocrq(["export", "first", "--wait"], home, env)
        # Then it names its files, and the JSONL has one line per file: the PDF's says pages: 2
        assert export.returncode == 0, export.stderr
        where = home / "var" / "store" / "results" / "first" / "export"
        assert f"exported 4 lines: {where / 'results.jsonl'}" in " ".join(export.stderr.split()), export.stderr
        lines = {Path(x["ref"]).name: x for x in map(json.loads, (where / "results.jsonl").read_text().splitlines())}
        assert set(lines) == {"invoice_en.png", "receipt_en.png", "two-pages.pdf", "broken.png"}
        assert all(x["status"] == "done" for x in lines.values())
        assert lines["two-pages.pdf"]["pages"] == 2 and len(lines["two-pages.pdf"]["page_texts"]) == 2
        assert "INVOICE" in lines["invoice_en.png"]["text"] and "营业" in lines["broken.png"]["text"]
        assert json.loads(export.stdout)["lines"] == 4  # stdout is a pipe: the marker as JSON
        status = json.loads(_ocrq(["status", "first"], home, env).stdout)
        assert (status["done"], status["failed"], status["total"]) == (4, 0, 4)
        assert status["cost"]["unit"] == "CPU-s" and status["cost"]["engines"] == ["rapidocr"]
    finally:
        down = _ocrq(["down"], home, env)
    # Then `ocrq down` stops what `ocrq up` started
    assert down.returncode == 0, down.stderr
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
