"""Messages published straight to Redis, around the producer, as anyone who can reach the broker
could: a real ``ocrq worker`` reads every field as a stranger's. A chunk whose job name would
step out of the store is dropped (logged, counted) and writes nothing anywhere; a chunk of a real
job name with fields ocrq never writes fails its images, typed and recorded, without fetching
them."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from ocrq import keys
from ocrq.messages import FINISH_JOB_TASK, OCR_CHUNK_TASK
from ocrq.results import ImageRecord
from producer.client import Client
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration


def _failed(client: Client, job: str, image_id: str) -> ImageRecord | None:
    doc = client.store.get_json(keys.failed_object(job, image_id))
    return ImageRecord.model_validate(doc["record"]) if isinstance(doc, dict) else None


def test_crafted_messages_are_refused_and_recorded_never_acted_on(redis_url: str, redis_client: Any,
                                                                  start_worker: Any, tmp_path: Path) -> None:
    images = tmp_path / "in"
    word_images(images, 3)
    files = sorted(str(p) for p in images.iterdir())
    store = tmp_path / "store"
    start_worker(worker_env(redis_url, store, [tmp_path], OCRQ_ENGINE__KIND="simulated", OCRQ_METRICS_PORT="0"))
    client = Client(settings_for(redis_url, store, limits={"allowed_roots": [tmp_path]}))
    escape = f"/tmp/ocrq-escape-{secrets.token_hex(4)}"
    try:
        # a job name that would write {store}/results/../../../../../../tmp/x/export/results.jsonl
        bad_job = "../../../../../../../../.." + escape
        client.app.send_task(OCR_CHUNK_TASK, args=[{"job": bad_job, "task": "text", "items": [
            {"id": keys.image_id(bad_job, files[0]), "ref": files[0]}]}])
        client.app.send_task(FINISH_JOB_TASK, args=[bad_job])
        # a real job name, fields the producer never writes: the images fail typed, unfetched
        items = [{"id": keys.image_id("crafted", f), "ref": f} for f in files]
        items[1]["attempt"] = "many"
        items[2]["row"] = ["not", "a", "row"]
        client.app.send_task(OCR_CHUNK_TASK, args=[{"job": "crafted", "task": "text", "items": items}])
        wrong_task = [{"id": keys.image_id("crafted-task", f), "ref": f} for f in files[:2]]
        client.app.send_task(OCR_CHUNK_TASK, args=[{"job": "crafted-task", "task": "__import__('os')",
                                                    "items": wrong_task}])
        # Celery's built-in tasks are no part of the worker: refused as unregistered
        client.app.send_task("celery.starmap", args=[{"task": "ocrq.ocr_chunk"}, [[{"job": bad_job, "items": []}]]])
        # and a real submission after them, which still runs
        job = client.submit(files, job="after")
        job.wait(timeout=120)
        deadline = time.monotonic() + 30
        while (_failed(client, "crafted-task", wrong_task[1]["id"]) is None
               or _failed(client, "crafted", items[2]["id"]) is None) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert not Path(escape).exists()
        assert not any(store.parent.glob("**/export/results.jsonl")) or job.export_marker() is not None
        for it, why in ((items[1], "attempt"), (items[2], "row")):
            rec = _failed(client, "crafted", it["id"])
            assert rec is not None and rec.error is not None and rec.error.type == "BadMessage", rec
            assert why in rec.error.message and rec.attempts == 1
        first = client.job("crafted").records()
        assert {r.id: r.status.value for r in first}[items[0]["id"]] == "done"
        for it in wrong_task:
            rec = _failed(client, "crafted-task", it["id"])
            assert rec is not None and rec.error is not None and rec.error.type == "BadMessage"
            assert "unknown task" in rec.error.message
        log = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("worker-*.log"))
        assert "dropped a chunk message" in log and "dropped a finish message" in log
        assert "Received unregistered task of type 'celery.starmap'" in log
        assert not redis_client.exists(keys.job_counts(bad_job))
    finally:
        client.close()
