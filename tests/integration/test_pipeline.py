"""End to end through real parts: producer → Redis (real server) → `ocrq worker` (a real Celery
worker process running RapidOCR) → local store / S3 (moto's HTTP server) → results."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ocrq import keys
from ocrq.jobs.failed import registered
from ocrq.results import ImageRecord, ImageStatus
from ocrq.settings import StoreSettings
from ocrq.store.storage import make_store
from producer.client import Client, SubmissionRefused
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration


def _corrupt(folder: Path) -> list[Path]:
    bad = [folder / "corrupt_random.png", folder / "corrupt_truncated.jpg", folder / "corrupt_text.jpg"]
    bad[0].write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    bad[1].write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"\x00" * 50)
    bad[2].write_text("this is not an image at all")
    return bad


def test_folder_with_duplicates_and_corrupt_files(redis_url, redis_client, start_worker, tmp_path):
    # Given 200 files: 40 distinct images, 157 byte-identical copies of them, 3 corrupt files
    src = tmp_path / "in"
    truth = word_images(src, 40)
    originals = sorted(truth)
    for i in range(157):
        orig = originals[i % len(originals)]
        copy = src / f"dup_{i:03d}{orig.suffix}"
        shutil.copyfile(orig, copy)
        truth[copy] = truth[orig]
    bad = _corrupt(src)
    assert len(list(src.iterdir())) == 200
    store = tmp_path / "store"
    start_worker(worker_env(redis_url, store, [tmp_path]))

    # When the folder is submitted and waited for
    client = Client(settings_for(redis_url, store, limits={"allowed_roots": [tmp_path]}))
    job = client.submit([str(src)], job="folder")
    counts = job.wait(timeout=600)
    results = {Path(r.record.ref): r for r in job.results()}

    # Then every image has a final result, nothing is missing
    assert counts["total"] == 200 and len(results) == 200
    assert counts["done"] == 197 and counts["failed"] == 3
    for path, words in truth.items():
        res = results[path]
        assert res.record.status.value == "done", res.record
        text = res.text.lower()
        missing = [w for w in words if w not in text]
        assert not missing, f"{path.name}: {missing} not in {res.text!r}"
    # the engine ran once per distinct content: at least 157 of the copies are cache hits
    assert counts["cached"] >= 157
    assert sum(r.record.cached for r in results.values()) == counts["cached"]
    # corrupt files failed on their first attempt with a typed, permanent error
    registry = {f.record.id for f in registered(client.index, client.store, "folder")}
    for path in bad:
        rec = results[path].record
        assert rec.status.value == "failed" and rec.attempts == 1
        assert rec.error is not None and rec.error.type in {"BadImage", "UnsupportedFormat"}, rec.error
        assert rec.id in registry
    # durable documents exist for every image (rows of the local store's database, read back): a
    # result part per stored chunk (not one object per image), every image a line of one
    local = make_store(StoreSettings(path=store))
    parts = list(local.list(keys.results_prefix("folder") + "parts/"))
    assert 0 < len(parts) < 200
    lines = [json.loads(ln) for data in local.get_many(parts, raw=True).values() for ln in data.splitlines()]
    assert sorted(ln["record"]["id"] for ln in lines) == sorted(r.record.id for r in results.values())


def test_resubmit_is_idempotent_and_second_job_hits_cache(redis_url, redis_client, start_worker, tmp_path):
    src = tmp_path / "in"
    truth = word_images(src, 6, seed=7)
    store = tmp_path / "store"
    start_worker(worker_env(redis_url, store, [tmp_path]))
    client = Client(settings_for(redis_url, store, limits={"allowed_roots": [tmp_path]}))

    first = client.submit([str(src)], job="a")
    assert first.wait(timeout=300)["done"] == 6
    # same job again: nothing left to publish, counts unchanged
    again = client.submit([str(src)], job="a")
    assert again.published == 0
    assert again.status()["done"] == 6 and again.status()["total"] == 6
    # another job with the same bytes: all cache hits, same text
    second = client.submit([str(src)], job="b")
    counts = second.wait(timeout=300)
    assert counts["cached"] == 6
    texts_a = {r.record.ref: r.text for r in first.results()}
    texts_b = {r.record.ref: r.text for r in second.results()}
    assert texts_a == texts_b and len(truth) == 6


def test_refused_and_missing_refs_are_refused_at_submit(redis_url, redis_client, start_worker, tmp_path):
    src = tmp_path / "in"
    word_images(src, 1)
    store = tmp_path / "store"
    start_worker(worker_env(redis_url, store, [src]))
    client = Client(settings_for(redis_url, store, limits={"allowed_roots": [src]}))
    outside = tmp_path / "outside.png"
    shutil.copyfile(src / "img_000.png", outside)
    refs = [str(src / "img_000.png"), str(src / "nope.png"), str(outside), "ftp://example.com/a.png"]
    with pytest.raises(SubmissionRefused) as info:
        client.submit(refs, job="typed")
    plan = info.value.plan
    assert (plan.accepted, plan.refused) == (1, 3)
    reasons = [e.reason for e in plan.refused_sample]
    assert reasons[0] == f"no such file: {src / 'nope.png'}"
    assert "outside allowed roots" in reasons[1] and "scheme 'ftp'" in reasons[2]
    assert not redis_client.exists(keys.job("typed")) and redis_client.llen("ocrq") == 0  # nothing published

    # the worker is still the boundary: a message naming a missing or outside file fails typed
    from ocrq.messages import OCR_CHUNK_TASK, Chunk, Item

    items = [Item(id=keys.image_id("raw", r), ref=r) for r in (str(src / "nope.png"), str(outside))]
    client.index.create("raw", {"task": "text", "params": {}})
    client.index.record([ImageRecord(id=it.id, job="raw", ref=it.ref, status=ImageStatus.queued) for it in items],
                        mode="submit")
    client.app.send_task(OCR_CHUNK_TASK, args=[Chunk(job="raw", items=items).to_message()], queue="ocrq")
    job = client.job("raw")
    assert job.wait(timeout=300)["failed"] == 2
    errors = {r.record.ref: r.record.error for r in job.results()}
    assert errors[str(src / "nope.png")].type == "MissingObject"
    assert errors[str(outside)].type == "RefusedRef"


def test_s3_prefix_in_results_to_s3(redis_url, start_worker, tmp_path, s3_endpoint, s3_bucket):
    s3, bucket = s3_bucket
    truth = word_images(tmp_path / "src", 5, seed=3)
    for path in truth:
        s3.put_object(Bucket=bucket, Key=f"scans/{path.name}", Body=path.read_bytes())
    env = worker_env(
        redis_url, tmp_path / "unused", [tmp_path],
        OCRQ_STORE__KIND="s3", OCRQ_STORE__BUCKET=bucket, OCRQ_STORE__PREFIX="out/",
        OCRQ_STORE__ENDPOINT_URL=s3_endpoint,
    )
    start_worker(env)
    settings = settings_for(redis_url, tmp_path / "unused")
    settings.store.kind = "s3"
    settings.store.bucket = bucket
    settings.store.prefix = "out/"
    settings.store.endpoint_url = s3_endpoint
    client = Client(settings)
    job = client.submit([f"s3://{bucket}/scans/"], job="s3job")
    counts = job.wait(timeout=300)
    assert counts["done"] == 5, counts
    results = {r.record.ref.rsplit("/", 1)[-1]: r for r in job.results()}
    for path, words in truth.items():
        assert all(w in results[path.name].text.lower() for w in words), results[path.name].text
    job.wait_export(timeout=120)
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="out/results/s3job/", Delimiter="/")
    # the results index + the export/ and parts/ "folders": documents are lines of result parts
    assert [c["Key"] for c in listed["Contents"]] == ["out/results/s3job/index.json"]
    assert [p["Prefix"] for p in listed["CommonPrefixes"]] == ["out/results/s3job/export/", "out/results/s3job/parts/"]
    cached = s3.list_objects_v2(Bucket=bucket, Prefix="out/cache/")
    assert cached["KeyCount"] == 5
    parts = s3.list_objects_v2(Bucket=bucket, Prefix="out/results/s3job/parts/")["Contents"]
    docs = [json.loads(line) for p in parts
            for line in s3.get_object(Bucket=bucket, Key=p["Key"])["Body"].read().splitlines()]
    assert len(docs) == 5 and {d["record"]["status"] for d in docs} == {"done"}


def test_multi_frame_tiff_gives_one_output_per_page(redis_url, start_worker, tmp_path):
    from PIL import Image

    src = tmp_path / "in"
    pages = word_images(tmp_path / "frames", 2, seed=21)
    frames = [Image.open(p).convert("RGB") for p in sorted(pages)]
    src.mkdir()
    frames[0].save(src / "two_pages.tif", save_all=True, append_images=frames[1:])
    start_worker(worker_env(redis_url, tmp_path / "store", [tmp_path]))
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))
    job = client.submit([str(src / "two_pages.tif")], job="tiff")
    assert job.wait(timeout=120)["done"] == 1
    (result,) = list(job.results())
    assert result.record.pages == 2 and [o.page for o in result.outputs] == [0, 1]
    for out, words in zip(result.outputs, [pages[p] for p in sorted(pages)], strict=True):
        assert all(w in out.text.lower() for w in words), out.text
