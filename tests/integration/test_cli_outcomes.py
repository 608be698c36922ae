"""What the command line tells a user, run for real (CLI processes, a real Redis, real workers):
settings mistakes in one line and exit 2; Redis unreachable said within 3 s; one exit-code table
for every waiting command; a task no engine can honour refused or failed typed, never `done`;
`status` a table on a terminal and JSON when piped, its cost named by what measured it;
`governor` on a CPU worker."""

from __future__ import annotations

import json
import os
import pty
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ocrq import keys
from ocrq.results import ImageStatus
from producer.client import Client
from tests.fixtures.images import render
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration


def _ocrq(args: list[str], env: dict[str, str], cwd: Path | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([sys.executable, "-m", "ocrq_cli", *args], env={**env, "COLUMNS": "300"}, cwd=cwd,
                         text=True, capture_output=True, timeout=timeout)
    print(f"$ ocrq {' '.join(args)} → {run.returncode}\n{run.stderr[-2500:]}{run.stdout[-1500:]}")
    return run


def _on_a_terminal(args: list[str], env: dict[str, str]) -> str:
    """What ``ocrq ARGS`` writes to a terminal (a pseudo-terminal on stdout and stderr)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ocrq_cli", *args], env={**env, "COLUMNS": "200"},
                            stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the other side closed
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(60)
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OCRQ_")}
    return {**env, **extra}


# --- settings -------------------------------------------------------------------------------

@pytest.mark.parametrize(("env", "args", "line"), [
    ({"OCRQ_LIMTS__MAX_BYTES": "5"}, ["jobs"],
     "settings: unknown setting OCRQ_LIMTS__MAX_BYTES (environment): did you mean OCRQ_LIMITS__MAX_BYTES?"),
    ({"OCRQ_CONFG": "configs/local.yaml"}, ["jobs"], "did you mean OCRQ_CONFIG?"),
    ({"OCRQ_ENGINE__KIND": "vlm"}, ["jobs"], "settings: setting engine.kind = 'vlm' (OCRQ_ENGINE__KIND): expected "
                                            "'rapidocr', 'transformers', 'vllm', 'vllm-server' or 'simulated'"),
    ({}, ["-c", "nonexist.yaml", "jobs"], "settings profile nonexist.yaml (OCRQ_CONFIG or --config) does not exist"),
    ({"OCRQ_CONFIG": "configs/gpu-vllm.yaml"}, ["jobs"], "settings profile configs/gpu-vllm.yaml"),
])
def test_a_settings_mistake_is_one_line_and_exit_2(tmp_path: Path, env: dict[str, str], args: list[str],
                                                   line: str) -> None:
    (tmp_path / "bad.yaml").write_text("limits:\n  allowed_rootz: [/data]\n")
    run = _ocrq(args, _clean_env(**env), cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert line in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr
    yaml_key = _ocrq(["-c", "bad.yaml", "jobs"], _clean_env(), cwd=tmp_path)
    assert yaml_key.returncode == 2
    assert "unknown setting limits.allowed_rootz (in bad.yaml): did you mean limits.allowed_roots?" in yaml_key.stderr
    # --debug adds the traceback
    debug = _ocrq(["--debug", *args], _clean_env(**env), cwd=tmp_path)
    assert debug.returncode == 2 and "Traceback" in debug.stderr and line in debug.stderr


# --- Redis unreachable ----------------------------------------------------------------------

@pytest.fixture()
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a Redis host behind a dead proxy)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.parametrize("command", [["status", "j"], ["submit", ".", "--job", "j"], ["jobs"], ["governor"]])
def test_redis_unreachable_is_said_within_3_seconds(silent_server: int, tmp_path: Path, command: list[str]) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    for port, within in ((dead_port, 3.0), (silent_server, 3.0 + 1.0)):  # + the 3 s the silence takes
        url = f"redis://127.0.0.1:{port}/0"
        t0 = time.monotonic()
        run = _ocrq(command, _clean_env(OCRQ_REDIS__URL=url), cwd=tmp_path, timeout=60)
        took = time.monotonic() - t0
        assert run.returncode == 2, run.stderr
        assert f"Unreachable: cannot reach Redis at {url}" in run.stderr and "`ocrq up`" in run.stderr
        assert "OCRQ_REDIS__URL" in run.stderr and "Traceback" not in run.stderr
        # (the interpreter's start is in `took` too: about a second here)
        assert took < within + 2.0, took


# --- one exit-code table --------------------------------------------------------------------

@pytest.fixture()
def sim_worker(redis_url: str, start_worker: Any, tmp_path: Path) -> dict[str, str]:
    store = tmp_path / "store"
    start_worker(worker_env(redis_url, store, [tmp_path], OCRQ_ENGINE__KIND="simulated",
                            OCRQ_ENGINE__EXTRA=json.dumps({"image_latency_s": 0.05})))
    return worker_env(redis_url, store, [tmp_path])


def test_every_waiting_command_exits_by_one_table(sim_worker: dict[str, str], tmp_path: Path) -> None:
    env = sim_worker
    src = tmp_path / "in"
    src.mkdir()
    for n in range(3):
        render(src / f"p{n}.png", [f"page {n}", "total 0{n}"])
    (src / "bad.png").write_bytes(b"not an image at all")
    # submit --wait: some failed → 3, naming the file and why
    first = _ocrq(["submit", str(src), "--job", "tbl", "--wait"], env)
    assert first.returncode == 3 and f"failed {src / 'bad.png'}: BadImage" in first.stderr, first.stderr
    # export --wait of a job with a failure: the export is written, and it still says 3
    exported = _ocrq(["export", "tbl", "--wait"], env)
    assert exported.returncode == 3 and "exported 4 lines" in exported.stderr, exported.stderr
    # reprocess --wait when the image fails again: 3, with the reason (it exited 0 before)
    again = _ocrq(["reprocess", "--job", "tbl", "--wait"], env)
    assert again.returncode == 3, again.stderr
    assert f"failed {src / 'bad.png'}: BadImage" in again.stderr
    assert "ImagesFailed: 1 of 1 reprocessed images failed in job tbl" in again.stderr
    # fixed: reprocess --wait → 0, export --wait → 0 with its path
    render(src / "bad.png", ["fixed now"])
    assert _ocrq(["reprocess", "--job", "tbl", "--wait"], env).returncode == 0
    fine = _ocrq(["export", "tbl", "--wait"], env)
    assert fine.returncode == 0 and f"results/tbl/export/{keys.EXPORT_JSONL}" in fine.stderr, fine.stderr
    # a wait that times out → 4 (a queue no worker listens to); an export of it unwaited → 2
    stuck_env = {**env, "OCRQ_QUEUE__NAME": "nobody-listens"}
    stuck = _ocrq(["submit", str(src / "p0.png"), "--job", "stuck", "--wait", "--timeout", "1"], stuck_env)
    assert stuck.returncode == 4 and "timed out after 1s: 0 of 1 image final" in stuck.stderr, stuck.stderr
    assert _ocrq(["export", "stuck", "--wait", "--timeout", "1"], stuck_env).returncode == 4
    unwaited = _ocrq(["export", "stuck"], stuck_env)
    assert unwaited.returncode == 2 and "NotFinished: job stuck is not finished" in unwaited.stderr
    # no such job → 1, with where to look
    missing = _ocrq(["status", "nope"], env)
    assert missing.returncode == 1 and "no such job: 'nope' (`ocrq jobs` lists the known ones)" in missing.stderr
    # the table is the one `ocrq --help` shows
    helped = _ocrq(["--help"], env)
    for code, meaning in ((0, "every image done"), (2, "refused"), (3, "some images failed"), (4, "timed out"),
                          (5, "not confirmed on the replicas")):
        assert f"{code}  {meaning}" in helped.stdout, helped.stdout


def test_status_is_a_table_on_a_terminal_and_json_when_piped(sim_worker: dict[str, str], tmp_path: Path) -> None:
    env = sim_worker
    render(tmp_path / "a.png", ["hello status"])
    assert _ocrq(["submit", str(tmp_path / "a.png"), "--job", "st", "--wait"], env).returncode == 0
    shown = _on_a_terminal(["status", "st"], env)
    # every status the README lists, then cached and skipped: one table, no JSON blob before it
    header = next(line for line in shown.splitlines() if "total" in line)
    for column in ["total", *[s.value for s in ImageStatus], "cached", "skipped"]:
        assert column in header, header
    assert "{" not in shown, shown
    # the cost is named by what measured it: the simulated engine runs on the CPU
    assert "CPU-s (simulated on CPU)" in shown and "/CPU-h (OCRQ_CPU_HOUR_USD)" in shown, shown
    assert "GPU" not in shown
    piped = _ocrq(["status", "st"], env)
    doc = json.loads(piped.stdout)
    assert doc["done"] == 1 and doc["cost"]["unit"] == "CPU-s" and doc["progress"]["finished"] == 1
    assert json.loads(_on_a_terminal(["status", "st", "--json"], env).strip())["total"] == 1


def test_governor_says_what_a_cpu_worker_batches_by(sim_worker: dict[str, str]) -> None:
    run = _ocrq(["governor"], sim_worker)
    assert run.returncode == 0 and run.stdout == ""
    assert "no governor snapshots" in run.stderr and "engine simulated on cpu, batch.mode fixed" in run.stderr


# --- tasks an engine cannot honour ----------------------------------------------------------

def test_a_task_rapidocr_cannot_honour_is_refused_or_failed_typed(redis_url: str, redis_client: Any,
                                                                  start_worker: Any, tmp_path: Path) -> None:
    store = tmp_path / "store"
    render(tmp_path / "a.png", ["bonjour"])
    client = Client(settings_for(redis_url, store, limits={"allowed_roots": [tmp_path]}))
    # Given a translation submitted while no worker is up (no engine to ask)
    early = client.submit([str(tmp_path / "a.png")], job="early", task="translate", params={"target_lang": "de"})
    # and then a RapidOCR worker
    start_worker(worker_env(redis_url, store, [tmp_path]))
    counts = early.wait(timeout=120)
    # Then the image failed, typed: not a `done` with untranslated text
    assert counts["failed"] == 1 and counts["done"] == 0, counts
    (result,) = list(early.results())
    assert result.record.error is not None and result.record.error.type == "UnsupportedTask"
    assert "does not run task 'translate'" in result.record.error.message
    # When a user asks for it with the worker up: refused at submit, exit 2, naming who can
    env = worker_env(redis_url, store, [tmp_path])
    refused = _ocrq(["submit", str(tmp_path / "a.png"), "--job", "tr", "--task", "translate"], env)
    assert refused.returncode == 2, refused.stderr
    assert ("UnsupportedTask: task 'translate' cannot run on this fleet's engines (rapidocr): it needs a worker "
            "with engine.kind transformers | vllm | vllm-server") in refused.stderr
    assert not redis_client.exists(keys.job("tr"))
    # and an OpenAI Batch line with a prompt of its own is rejected, its error line says why
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": str(tmp_path / "a.png")}},
                {"type": "text", "text": "Translate this to German"}]}]}}
    plain = {**line, "custom_id": "c2", "body": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(tmp_path / "a.png")}}]}]}}
    (tmp_path / "b.jsonl").write_text(json.dumps(line) + "\n" + json.dumps(plain) + "\n")
    batch = _ocrq(["submit", "--openai-batch", str(tmp_path / "b.jsonl"), "--job", "ob", "--wait", "--out",
                   str(tmp_path / "out")], env)
    assert batch.returncode == 3, batch.stderr
    (error,) = [json.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert error["custom_id"] == "c1" and error["error"]["code"] == "UnsupportedTask"
    assert "custom prompt" in error["error"]["message"]
    (done,) = [json.loads(x) for x in (tmp_path / "out" / "output.jsonl").read_text().splitlines()]
    assert done["custom_id"] == "c2" and "bonjour" in done["response"]["body"]["choices"][0]["message"]["content"]
