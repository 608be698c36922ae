"""The shared contract: ids, cache keys, errors, settings, retry policy, prefetch sizing."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from ocrq import keys
from ocrq.errors import BadImage, EngineOOM, OcrqError, RefusedRef, classify, error_from_dict
from ocrq.messages import Chunk, Item
from ocrq.results import ImageRecord, ImageResult, ImageStatus, OcrLine, OcrOutput
from ocrq.settings import Settings, load_settings
from worker.chunk.retry import backoff, should_retry
from worker.prefetch import desired_prefetch


def test_ids_are_deterministic_and_distinct():
    assert keys.image_id("j", "/a.png") == keys.image_id("j", "/a.png")
    assert keys.image_id("j", "/a.png") != keys.image_id("k", "/a.png")
    assert keys.image_id("j", "/a.png") != keys.image_id("j", "/b.png")


def test_a_manifest_row_is_part_of_the_image_id_and_comes_back_in_the_result_line():
    row = {"id": "doc-1", "metadata": {"k": [1, 2]}}
    assert keys.image_id("j", "/a.png", None) == keys.image_id("j", "/a.png", {}) == keys.image_id("j", "/a.png")
    assert keys.image_id("j", "/a.png", row) != keys.image_id("j", "/a.png")
    assert keys.image_id("j", "/a.png", row) == keys.image_id("j", "/a.png", {"metadata": {"k": [1, 2]}, "id": "doc-1"})
    rec = ImageRecord(id="i", job="j", ref="/a.pdf", status=ImageStatus.done, pages=2, row=row)
    outs = [OcrOutput(text=f"page {n}", lines=[OcrLine(text=f"page {n}")], engine="e", model="m", page=n)
            for n in (0, 1)]
    line = ImageResult(record=rec, outputs=outs).to_line()
    assert line["row"] == row and line["page_texts"] == ["page 0", "page 1"]
    assert [ln["page"] for ln in line["lines"]] == [0, 1]
    # the record round-trips through the job index's JSON with its row
    assert ImageRecord.model_validate_json(rec.model_dump_json(exclude_none=True)).row == row


def test_export_paths_live_under_the_results_prefix():
    assert keys.export_object("j", keys.EXPORT_SUCCESS) == "results/j/export/_SUCCESS"
    assert keys.export_object("j", keys.EXPORT_JSONL).startswith(keys.results_prefix("j"))


def test_cache_key_covers_content_model_task_params():
    base = keys.cache_key("ab" * 32, "rapidocr-3.10", "text", {})
    assert base == keys.cache_key("ab" * 32, "rapidocr-3.10", "text", {})
    assert base != keys.cache_key("cd" * 32, "rapidocr-3.10", "text", {})
    assert base != keys.cache_key("ab" * 32, "hunyuan-1.5", "text", {})
    assert base != keys.cache_key("ab" * 32, "rapidocr-3.10", "parse", {})
    assert base != keys.cache_key("ab" * 32, "rapidocr-3.10", "text", {"max_new_tokens": 10})
    # parameter order does not matter
    assert keys.cache_key("a", "r", "t", {"x": 1, "y": 2}) == keys.cache_key("a", "r", "t", {"y": 2, "x": 1})


def test_governor_fingerprint_changes_with_model_settings_and_device():
    engine = Settings().engine.model_dump(mode="json")
    base = keys.governor_fingerprint("rev-a", engine, 24 * 2**30)
    assert base == keys.governor_fingerprint("rev-a", dict(engine), 24 * 2**30)
    assert base != keys.governor_fingerprint("rev-b", engine, 24 * 2**30)
    assert base != keys.governor_fingerprint("rev-a", {**engine, "max_new_tokens": 99}, 24 * 2**30)
    assert base != keys.governor_fingerprint("rev-a", engine, 48 * 2**30)
    assert keys.governor_profile(base) == f"ocrq:governor:{base}"


def test_error_tree_round_trip():
    assert EngineOOM("x").to_dict() == {"type": "EngineOOM", "message": "x", "retryable": True}
    assert isinstance(error_from_dict(BadImage("bad").to_dict()), BadImage)
    assert not RefusedRef("no").retryable
    wrapped = classify(ValueError("boom"))
    assert isinstance(wrapped, OcrqError) and wrapped.retryable and "ValueError" in str(wrapped)


def test_retry_policy():
    assert should_retry(EngineOOM("x"), attempt=1, max_attempts=4)
    assert not should_retry(EngineOOM("x"), attempt=4, max_attempts=4)
    assert not should_retry(BadImage("x"), attempt=1, max_attempts=4)
    rng = random.Random(0)
    delays = [backoff(a, 2.0, 300.0, rng) for a in range(1, 12)]
    assert all(0 < d <= 300 for d in delays)
    assert backoff(1, 2.0, 300.0, random.Random(1)) <= 2.0 < backoff(5, 2.0, 300.0, random.Random(1))


def test_prefetch_follows_backlog_within_bounds():
    assert desired_prefetch(0, 64, 4, 0) == 1
    assert desired_prefetch(64, 64, 4, 0) == 1
    assert desired_prefetch(65, 64, 4, 0) == 2
    assert desired_prefetch(10_000, 64, 4, 0) == 4
    assert desired_prefetch(10, 64, 4, 3) == 4  # ETA-held retries do not block new work


def test_settings_env_and_yaml(tmp_path, monkeypatch):
    profile = tmp_path / "p.yaml"
    profile.write_text("engine:\n  kind: vllm\n  max_num_seqs: 8\nqueue:\n  chunk_size: 32\n")
    monkeypatch.setenv("OCRQ_CONFIG", str(profile))
    monkeypatch.setenv("OCRQ_QUEUE__CHUNK_SIZE", "16")
    s = Settings()
    assert s.engine.kind == "vllm" and s.engine.max_num_seqs == 8
    assert s.queue.chunk_size == 16  # env beats YAML
    monkeypatch.delenv("OCRQ_CONFIG")
    monkeypatch.delenv("OCRQ_QUEUE__CHUNK_SIZE")
    assert load_settings().engine.kind == "rapidocr"


def test_load_settings_with_a_profile_leaves_the_environment_alone(tmp_path, monkeypatch):
    profile = tmp_path / "p.yaml"
    profile.write_text("queue:\n  chunk_size: 8\n")
    monkeypatch.delenv("OCRQ_CONFIG", raising=False)
    assert load_settings(profile).queue.chunk_size == 8
    assert "OCRQ_CONFIG" not in os.environ
    assert load_settings().queue.chunk_size != 8  # the profile applied to that one call only


def test_settings_reject_bad_values(monkeypatch):
    monkeypatch.setenv("OCRQ_ENGINE__KIND", "tesseract")
    with pytest.raises(ValueError):
        Settings()


def test_message_and_result_schema():
    chunk = Chunk(job="j", items=[Item(id="i", ref="/a.png")])
    assert Chunk.model_validate(chunk.to_message()) == chunk
    out = OcrOutput(text="hi", lines=[OcrLine(text="hi", box=[[0, 0], [1, 0], [1, 1], [0, 1]])],
                    engine="rapidocr", model="m")
    res = ImageResult(record=ImageRecord(id="i", job="j", ref="/a.png", status=ImageStatus.done), outputs=[out])
    line = res.to_line()
    assert {"ref", "status", "text", "cached", "attempts", "error"} <= set(line)
    assert line["text"] == "hi" and line["status"] == "done" and line["error"] is None


def test_the_local_store_follows_var_dir_unless_its_path_is_given(monkeypatch):
    monkeypatch.delenv("OCRQ_STORE__PATH", raising=False)
    monkeypatch.setenv("OCRQ_VAR_DIR", "/srv/ocrq")
    assert load_settings().store.path == Path("/srv/ocrq/store")
    monkeypatch.setenv("OCRQ_STORE__PATH", "/data/results")
    assert load_settings().store.path == Path("/data/results")
    monkeypatch.delenv("OCRQ_STORE__PATH")
    assert "path" not in load_settings().store.model_fields_set  # a producer may still ask the workers
