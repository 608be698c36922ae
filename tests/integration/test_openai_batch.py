"""OpenAI Batch files in and out, against a real Redis, real `ocrq worker` processes, real
`ocrq submit` processes and moto's S3 server (the store, the batch file and some images on it):
a producer and a worker killed mid-job, the same command run again, and every custom_id ends in
exactly one of the output and error files. OCRQ_TEST_BATCH_LINES sets the file's size (300;
2000 for the full run)."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageDraw

from ocrq import keys
from ocrq.prompts import prompt
from tests.integration.conftest import worker_env

pytestmark = pytest.mark.integration

LINES = int(os.environ.get("OCRQ_TEST_BATCH_LINES", "300"))
FAST_REAPER = {"OCRQ_REDIS__DEAD_WORKER_S": "4", "OCRQ_REDIS__REAPER_INTERVAL_S": "1"}
MAX_BYTES = 200_000


def _png(i: int) -> bytes:
    img = Image.new("L", (96, 32), 255)
    ImageDraw.Draw(img).text((4, 8), f"line {i:05d}", fill=0)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _line(custom_id: str, url: str, text: str | None = None, **body: Any) -> str:
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}}]
    if text is not None:
        content.append({"type": "text", "text": text})
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tencent/HunyuanOCR", "messages": [{"role": "user", "content": content}],
                                **body}})


def _batch_file(s3: Any, bucket: str, n: int) -> tuple[str, set[str], Counter[str]]:
    """An input file of ``n`` good lines (data: URIs, s3:// images; known and custom prompts,
    max_tokens) and a few bad ones; returns its body, the good custom_ids, and the bad ones."""
    lines = []
    good: set[str] = set()
    for i in range(n):
        cid = f"req-{i:05d}"
        if i % 10 == 3:  # an image on S3, by its key
            s3.put_object(Bucket=bucket, Key=f"images/{i}.png", Body=_png(i))
            url = f"s3://{bucket}/images/{i}.png"
        else:
            url = "data:image/png;base64," + base64.b64encode(_png(i)).decode()
        text = [prompt("text"), prompt("spotting", version="1.0"), "Read the serial number.", None][i % 4]
        lines.append(_line(cid, url, text, **({"max_tokens": 512} if i % 5 == 0 else {})))
        good.add(cid)
    oversize = "data:image/png;base64," + "A" * (MAX_BYTES * 2)
    bad = [
        ("", "{not json"),
        ("req-00001", _line("req-00001", "data:image/png;base64," + base64.b64encode(_png(1)).decode())),
        ("no-image", json.dumps({"custom_id": "no-image", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "m", "messages": [{"role": "user", "content": "hello"}]}})),
        ("too-large", _line("too-large", oversize)),
        ("outside", _line("outside", "/etc/passwd")),
    ]
    for at, (_, text) in zip((7, n // 2, n // 3, n - 2, 11), bad, strict=True):
        lines.insert(at, text)
    return "\n".join(lines) + "\n", good, Counter(cid for cid, _ in bad)


def _submit(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ocrq_cli", "submit", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _wait_object(s3: Any, bucket: str, key: str, timeout: float = 60) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        except s3.exceptions.NoSuchKey:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["custom_id"] for line in path.read_text().splitlines() if line.strip()]


def test_a_batch_file_survives_a_killed_producer_and_worker(redis_url, redis_client, start_worker, tmp_path,
                                                           s3_endpoint, s3_bucket):
    from openai.types.chat import ChatCompletion

    s3, bucket = s3_bucket
    body, good, bad = _batch_file(s3, bucket, LINES)
    s3.put_object(Bucket=bucket, Key="in/batch.jsonl", Body=body.encode())
    store = {"OCRQ_STORE__KIND": "s3", "OCRQ_STORE__BUCKET": bucket, "OCRQ_STORE__PREFIX": "ocr/",
             "OCRQ_STORE__ENDPOINT_URL": s3_endpoint, "OCRQ_LIMITS__MAX_BYTES": str(MAX_BYTES)}
    sim = {"OCRQ_ENGINE__KIND": "simulated", "OCRQ_ENGINE__EXTRA": json.dumps({"image_latency_s": 0.03}),
           "OCRQ_QUEUE__CHUNK_SIZE": "8", **FAST_REAPER, **store}
    victim = start_worker(worker_env(redis_url, tmp_path / "unused", [tmp_path], **sim), name="victim")
    start_worker(worker_env(redis_url, tmp_path / "unused", [tmp_path], **sim), name="keeper")
    env = {**worker_env(redis_url, tmp_path / "unused", [tmp_path], **store)}
    out = tmp_path / "out"
    command = ["--openai-batch", f"s3://{bucket}/in/batch.jsonl", "--job", "batch", "--wait", "--out", str(out)]
    t0 = time.monotonic()

    # Given a producer following the job, killed with a worker once part of the output is written
    first = _submit(command, env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None:
        written = _ids(out / "output.jsonl") if (out / "output.jsonl").exists() else []
        if len(written) >= LINES // 5:
            break
        time.sleep(0.05)
    assert first.poll() is None, first.communicate()
    # (the output is readable while the job runs, and has no marker yet)
    assert len(set(written)) == len(written) >= LINES // 5 and not (out / "_SUCCESS").exists()
    os.killpg(first.pid, signal.SIGKILL)
    os.killpg(victim.pid, signal.SIGKILL)
    print(f"killed the producer and a worker after {time.monotonic() - t0:.1f}s, {len(written)} lines written")
    first.wait(10)
    victim.wait(10)
    assert redis_client.hget(keys.job_counts("batch"), "total") is not None

    # When the same command runs again
    again = _submit(command, env)
    stdout, stderr = again.communicate(timeout=600)
    took = time.monotonic() - t0
    print(f"{LINES} lines: {took:.1f}s from the first submit to the second's exit")
    # Then it exits 3 (some lines could not run), and every custom_id is in exactly one file
    assert again.returncode == 3, stderr
    output, errors = _ids(out / "output.jsonl"), _ids(out / "errors.jsonl")
    seen = Counter(output) + Counter(errors)
    assert Counter(output) == Counter(good), "every good line is done, once"
    assert seen == Counter(good) + bad, "and every bad line has its error line"
    assert json.loads((out / "_SUCCESS").read_text())["complete"] is True
    for line in (out / "output.jsonl").read_text().splitlines():
        envelope = json.loads(line)
        assert envelope["response"]["status_code"] == 200 and envelope["error"] is None
        completion = ChatCompletion.model_validate(envelope["response"]["body"])
        assert completion.choices[0].message.content.startswith("sim:")
    reasons = {e["custom_id"]: e["error"]["code"] for e in map(json.loads, (out / "errors.jsonl").open())}
    assert reasons == {"": "InvalidLine", "req-00001": "DuplicateCustomId", "no-image": "InvalidLine",
                       "too-large": "TooLarge", "outside": "RefusedRef"}
    # and the job's own export (a worker writes it when the job finishes) has the same lines
    assert json.loads(_wait_object(s3, bucket, "ocr/" + keys.openai_export_object("batch", "_SUCCESS")))[
        "lines"] == len(good)
    exported = s3.get_object(Bucket=bucket, Key="ocr/" + keys.openai_export_object("batch", "output.jsonl"))
    assert sorted(exported["Body"].read().splitlines()) == sorted((out / "output.jsonl").read_bytes().splitlines())

    # When the same file is submitted once more: nothing runs again, and the files are the same
    before = (out / "output.jsonl").read_bytes()
    third = _submit(command, env)
    _, stderr = third.communicate(timeout=300)
    assert third.returncode == 3 and "0 images submitted" in stderr, stderr
    assert sorted((out / "output.jsonl").read_bytes().splitlines()) == sorted(before.splitlines())


def test_reprocess_runs_a_failed_line_again_with_its_own_task_and_params(redis_url, start_worker, tmp_path,
                                                                        s3_endpoint, s3_bucket):
    s3, bucket = s3_bucket
    png = _png(7)
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    spotting = prompt("spotting", version="1.0")
    body = "\n".join([
        _line("late-spot", f"s3://{bucket}/late.png", spotting, max_tokens=77),  # not there yet
        _line("twin-spot", uri, spotting, max_tokens=77),
        _line("twin-text", uri),
    ]) + "\n"
    (tmp_path / "batch.jsonl").write_text(body)
    store = {"OCRQ_STORE__KIND": "s3", "OCRQ_STORE__BUCKET": bucket, "OCRQ_STORE__PREFIX": "ocr/",
             "OCRQ_STORE__ENDPOINT_URL": s3_endpoint}
    start_worker(worker_env(redis_url, tmp_path / "unused", [tmp_path], OCRQ_ENGINE__KIND="simulated", **store))
    env = worker_env(redis_url, tmp_path / "unused", [tmp_path], **store)
    # Given a batch whose first line failed (its image was missing)
    first = _submit(["--openai-batch", str(tmp_path / "batch.jsonl"), "--job", "late", "--wait"], env)
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 3, stderr
    # When the image is there and the failed line is reprocessed
    s3.put_object(Bucket=bucket, Key="late.png", Body=png)
    again = subprocess.run([sys.executable, "-m", "ocrq_cli", "reprocess", "--job", "late", "--wait"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "re-published 1 image that failed" in again.stderr, again.stderr
    export = subprocess.run([sys.executable, "-m", "ocrq_cli", "export", "late", "--format", "openai-batch",
                             "--out", str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr
    # Then it ran with its own task and params (the same answer as its twin), not the job's
    texts = {e["custom_id"]: e["response"]["body"]["choices"][0]["message"]["content"]
             for e in map(json.loads, (tmp_path / "out" / "output.jsonl").open())}
    assert texts["late-spot"] == texts["twin-spot"] != texts["twin-text"]
    assert (tmp_path / "out" / "errors.jsonl").read_text() == ""
    assert json.loads((tmp_path / "out" / "_SUCCESS").read_text())["complete"] is True
