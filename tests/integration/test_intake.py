"""ETL intake through real parts: the `ocrq` CLI and the producer API → real Redis → a real
`ocrq worker` (RapidOCR) → local store or moto's S3 server. Every file accounted for, PDFs page
by page, guards that fail before publishing, manifest rows joined back, the job's export."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from ocrq import keys
from producer.client import Client
from tests.fixtures.images import render, word_images
from tests.integration.conftest import settings_for, worker_env
from tests.unit.test_documents import encrypt

pytestmark = pytest.mark.integration


def ocrq(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    # a wide terminal: rich wraps long paths otherwise
    return subprocess.run([sys.executable, "-m", "ocrq_cli", *args], env={**env, "COLUMNS": "400"}, cwd=cwd, text=True,
                          capture_output=True, timeout=timeout)


def pdf_of(images: list[Image.Image], resolution: float = 100.0) -> bytes:
    # copies: Pillow keeps append_images in an appended image's encoderinfo, and would reuse it
    images = [im.copy() for im in images]
    buf = io.BytesIO()
    images[0].save(buf, "PDF", save_all=True, append_images=images[1:], resolution=resolution)
    return buf.getvalue()


def word_pages(folder: Path, n: int, seed: int) -> tuple[list[Image.Image], list[list[str]]]:
    truth = word_images(folder, n, seed=seed)
    paths = sorted(truth)
    return [Image.open(p).convert("RGB") for p in paths], [truth[p] for p in paths]


def test_a_folder_of_odd_files_is_all_accounted_for(redis_url, start_worker, tmp_path):
    # Given a folder of what scanners and users leave behind, named or not by their format
    src = tmp_path / "scans"
    src.mkdir()
    base = Image.open(render(tmp_path / "base.png", ["harbor invoice", "total 042"])).convert("RGB")
    for fmt, name in [("PNG", "a.png"), ("JPEG", "b.jpg"), ("JPEG2000", "c.jp2"), ("PPM", "d.pgm"),
                      ("TGA", "e.tga"), ("QOI", "f.qoi"), ("AVIF", "g.avif"), ("BMP", "h.bmp"),
                      ("TIFF", "i.tif"), ("WEBP", "j.webp"), ("PNG", "scan_without_extension"),
                      ("JPEG", "k.JPEG2")]:
        (base.convert("L") if fmt == "PPM" else base).save(src / name, fmt)
    base.resize((256, 86)).save(src / "l.ico", "ICO")
    (src / "m.pdf").write_bytes(pdf_of([base]))
    (src / "notes.txt").write_text("not an image")
    (src / "empty.png").write_bytes(b"")
    (src / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (src / "list.csv").write_text("ref\na.png\n")
    (src / "sub").mkdir()
    (src / "sub" / "n.png").write_bytes((src / "a.png").read_bytes())
    accepted = 17  # every regular file but the hidden one and the manifest
    store = tmp_path / "store"
    start_worker(worker_env(redis_url, store, [tmp_path]))

    # When a user submits it with the CLI from another directory, with no roots or store path of
    # their own (both come from the live worker's state)
    env = worker_env(redis_url, store, [])
    env.pop("OCRQ_LIMITS__ALLOWED_ROOTS")
    env.pop("OCRQ_STORE__PATH")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "results.jsonl"
    run = ocrq(["submit", str(src), "--job", "odd", "--wait", "--out", str(out)], env, elsewhere)

    # Then the summary accounts for every file before anything runs, and every accepted file has
    # a result: images done, whatever their extension; the rest failed with a typed error
    assert f"{accepted} accepted, 2 skipped, 0 refused" in run.stderr, run.stderr
    assert ".DS_Store: hidden" in run.stderr and "list.csv: a manifest inside a folder" in run.stderr
    assert run.returncode == 3, run.stderr  # some failed
    lines = {Path(line["ref"]).name: line for line in map(json.loads, out.read_text().splitlines())}
    assert len(lines) == accepted
    failed = {name: line["error"]["type"] for name, line in lines.items() if line["status"] == "failed"}
    assert failed == {"notes.txt": "BadImage", "empty.png": "BadImage"}, failed
    assert all(line["attempts"] == 1 for line in lines.values())
    for name in ("a.png", "b.jpg", "c.jp2", "d.pgm", "e.tga", "f.qoi", "scan_without_extension", "k.JPEG2",
                 "m.pdf"):
        assert "harbor" in lines[name]["text"].lower(), (name, lines[name]["text"])
    status = ocrq(["status", "odd"], env, elsewhere)
    counts = json.loads(status.stdout)
    assert counts["total"] == accepted and counts["skipped"] == 2 and counts["failed"] == 2
    # and --wait names what failed, and why, and where to go from there
    assert f"failed {src / 'notes.txt'}: BadImage" in run.stderr, run.stderr
    assert f"failed {src / 'empty.png'}: BadImage" in run.stderr
    assert "`ocrq failed --job odd` lists the 2 images that failed" in run.stderr

    # When the same folder is submitted again: nothing to publish, said so, and no made-up rate
    again = ocrq(["submit", str(src), "--job", "odd", "--wait"], env, elsewhere)
    assert "0 images submitted" in again.stderr and "already finished" in again.stderr, again.stderr
    assert "img/s" not in again.stderr
    # --match takes the files found whose name matches, in any case; the rest are skipped, with why
    some = ocrq(["submit", str(src), "--job", "some", "--match", "*.png", "-m", "*.JPG"], env, elsewhere)
    assert some.returncode == 0, some.stderr
    assert "4 accepted, 15 skipped, 0 refused" in some.stderr, some.stderr
    assert f"skipped {src / 'notes.txt'}: its name matches none of *.png, *.jpg" in some.stderr, some.stderr
    path_like = ocrq(["submit", str(src), "--job", "some2", "--match", "scans/*.png"], env, elsewhere)
    assert path_like.returncode == 2 and "not its path" in path_like.stderr, path_like.stderr
    # A task the engines do not know, or a parameter without a value, is refused before anything
    for bad in (["--task", "bogus"], ["--param", "foo"]):
        refused = ocrq(["submit", str(src / "a.png"), "--job", "odd2", *bad], env, elsewhere)
        assert refused.returncode == 2, refused.stderr
        assert "unknown task 'bogus'" in refused.stderr or "expected key=value" in refused.stderr, refused.stderr
    # A wait that times out (no worker on this queue) says how far the job got and how to follow it
    stuck = ocrq(["submit", str(src / "a.png"), "--job", "stuck", "--wait", "--timeout", "1"],
                 {**env, "OCRQ_QUEUE__NAME": "nobody-listens"}, elsewhere)
    assert stuck.returncode == 4, stuck.stderr
    assert "timed out after 1s: 0 of 1 image final in job stuck (queued 1" in stuck.stderr, stuck.stderr
    assert "`ocrq status stuck` follows it" in stuck.stderr


def test_a_three_page_pdf_gives_three_page_outputs_and_pages_hit_the_cache(redis_url, start_worker, tmp_path):
    images, words = word_pages(tmp_path / "pages", 3, seed=31)
    src = tmp_path / "docs"
    src.mkdir()
    (src / "three.pdf").write_bytes(pdf_of(images))
    store = tmp_path / "store"
    start_worker(worker_env(redis_url, store, [tmp_path]))
    client = Client(settings_for(redis_url, store, limits={"allowed_roots": [tmp_path]}))

    job = client.submit([str(src / "three.pdf")], job="pdf")
    assert job.wait(timeout=300)["done"] == 1
    (result,) = list(job.results())
    assert result.record.pages == 3 and [o.page for o in result.outputs] == [0, 1, 2]
    line = result.to_line()
    assert len(line["page_texts"]) == 3
    for text, page_words in zip(line["page_texts"], words, strict=True):
        assert all(w in text.lower() for w in page_words), (text, page_words)
    assert {ln["page"] for ln in line["lines"]} == {0, 1, 2}
    # pages were rendered at pdf_dpi (900x300 px at 100 dpi -> 1800x600 at 200 dpi)
    assert (result.outputs[0].width, result.outputs[0].height) == (1800, 600)

    # the second page, alone in another PDF (other bytes), is a cache hit: pages are cached by pixels
    (src / "excerpt.pdf").write_bytes(pdf_of([images[1]]))
    again = client.submit([str(src / "excerpt.pdf")], job="pdf2")
    assert again.wait(timeout=300)["cached"] == 1
    (hit,) = list(again.results())
    assert hit.record.cached and hit.text == result.outputs[1].text


def test_encrypted_and_broken_pdfs_fail_typed_on_the_first_attempt(redis_url, start_worker, tmp_path):
    images, _ = word_pages(tmp_path / "pages", 2, seed=5)
    src = tmp_path / "docs"
    src.mkdir()
    data = pdf_of(images)
    (src / "locked.pdf").write_bytes(encrypt(data))
    (src / "broken.pdf").write_bytes(b"%PDF-1.7\n1 0 obj\n<<>>\nendobj\n")
    store = tmp_path / "store"
    start_worker(worker_env(redis_url, store, [tmp_path]))
    client = Client(settings_for(redis_url, store, limits={"allowed_roots": [tmp_path]}))
    job = client.submit([str(src)], job="locked")
    assert job.wait(timeout=300)["failed"] == 2
    errors = {Path(r.record.ref).name: r.record for r in job.results()}
    assert errors["locked.pdf"].error.type == "EncryptedDocument"
    assert errors["broken.pdf"].error.type == "BadDocument"
    assert all(rec.attempts == 1 and not rec.error.retryable for rec in errors.values())


def test_outside_the_roots_is_refused_at_submit_and_nothing_is_published(redis_url, redis_client,
                                                                          start_worker, tmp_path):
    allowed = tmp_path / "allowed"
    word_images(allowed, 1)
    outside = tmp_path / "data" / "scans"
    word_images(outside, 2, seed=3)
    store = tmp_path / "store"
    start_worker(worker_env(redis_url, store, [allowed]))
    env = worker_env(redis_url, store, [allowed])

    run = ocrq(["submit", str(allowed), str(outside), str(allowed / "missing.png"), "--job", "refused",
                "--wait"], env, tmp_path)
    assert run.returncode == 2, run.stderr
    text = " ".join(run.stderr.split())  # rich wraps long lines
    assert "1 accepted, 0 skipped, 2 refused" in text  # the outside folder is refused as a whole
    assert f"outside allowed roots ({allowed}): {outside}" in text
    assert f"OCRQ_LIMITS__ALLOWED_ROOTS='[\"{outside}\"]'" in text and f"ocrq up --allow {outside}" in text
    assert f"no such file: {allowed / 'missing.png'}" in text
    # nothing published: no job, no message on the queue
    assert redis_client.llen("ocrq") == 0 and not redis_client.exists(keys.job("refused"))
    status = ocrq(["status", "refused"], env, tmp_path)
    assert status.returncode == 1 and "no such job" in status.stderr

    # the producer allows it, the worker does not: refused too, naming the workers' roots
    env_wide = worker_env(redis_url, store, [tmp_path])
    run = ocrq(["submit", str(outside), "--job", "refused"], env_wide, tmp_path)
    assert run.returncode == 2 and "outside the allowed roots of the running workers" in " ".join(run.stderr.split())
    assert redis_client.llen("ocrq") == 0 and not redis_client.exists(keys.job("refused"))


def test_manifest_rows_are_joined_back_and_the_export_ends_with_success(redis_url, start_worker, tmp_path,
                                                                        s3_endpoint, s3_bucket):
    s3, bucket = s3_bucket
    truth = word_images(tmp_path / "src", 3, seed=11)
    paths = sorted(truth)
    rows: list[dict[str, Any]] = [
        {"ref": paths[0].name, "id": "doc-1", "metadata": {"customer": 17, "tags": ["a", "b"]}},
        {"ref": paths[1].name, "id": "doc-2", "metadata": None},
        {"ref": paths[2].name, "id": "doc-3", "metadata": {"nested": {"x": 1.5}}},
        {"ref": paths[0].name, "id": "doc-4"},  # the same file under another record: its own result
    ]
    manifest = tmp_path / "src" / "batch.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s3_env = {"OCRQ_STORE__KIND": "s3", "OCRQ_STORE__BUCKET": bucket, "OCRQ_STORE__PREFIX": "ocr/",
              "OCRQ_STORE__ENDPOINT_URL": s3_endpoint}
    env = worker_env(redis_url, tmp_path / "unused", [tmp_path], **s3_env)
    start_worker(env)

    run = ocrq(["submit", str(manifest), "--job", "etl", "--wait", "--parquet"], env, tmp_path)
    assert run.returncode == 0, run.stderr  # every image done
    assert "4 accepted, 0 skipped, 0 refused" in run.stderr

    settings = settings_for(redis_url, tmp_path / "unused")
    settings.store = settings.store.model_copy(update={"kind": "s3", "bucket": bucket, "prefix": "ocr/",
                                                       "endpoint_url": s3_endpoint})
    marker = Client(settings).job("etl").wait_export(timeout=120)
    assert marker["lines"] == 4 and marker["files"] == ["results.jsonl", "results.parquet"]

    def obj(name: str) -> dict[str, Any]:
        return s3.get_object(Bucket=bucket, Key=f"ocr/{keys.export_object('etl', name)}")

    jsonl = obj("results.jsonl")
    success = obj("_SUCCESS")
    assert success["LastModified"] >= jsonl["LastModified"]
    lines = [json.loads(x) for x in jsonl["Body"].read().decode().splitlines()]
    assert len(lines) == 4
    by_id = {line["row"]["id"]: line for line in lines}
    for row in rows:  # every row comes back unchanged: the ETL joins on its own id
        line = by_id[row["id"]]
        assert line["row"] == {k: v for k, v in row.items() if k != "ref"}
        assert line["status"] == "done" and Path(line["ref"]).name == row["ref"]
        assert all(w in line["text"].lower() for w in truth[tmp_path / "src" / row["ref"]])

    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(obj("results.parquet")["Body"].read()))
    assert table.num_rows == 4 and sorted(table.column("row_id").to_pylist()) == ["doc-1", "doc-2", "doc-3", "doc-4"]
    assert json.loads(table.to_pylist()[0]["row"]) == by_id[table.to_pylist()[0]["row_id"]]["row"]
