"""Both vLLM engines inside a real `ocrq worker` process, end to end through Redis: the
in-process engine (`engine.kind=vllm`) and the client of a real vLLM server subprocess
(`worker.engines.vllm.serve`, one API process) on loopback (`engine.kind=vllm-server`).
Tiny random checkpoint, fp32 on CPU; the batch-invariance checks live in test_vllm_engine.py
and test_vllm_server.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ocrq import keys
from producer.client import Client
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env, worker_start_state
from tests.integration.vllm_support import (
    engine_settings,
    require_vllm,
    running_server,
    tiny_checkpoint,
    vllm_env,
)
from worker.engines.vllm.kv_gate import DEFAULT_OVERCOMMIT

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture(scope="module")
def venv_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    require_vllm()
    return vllm_env(tmp_path_factory.mktemp("vllm-worker-env"))


@pytest.fixture(scope="module")
def checkpoint(venv_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory)


def _engine_env(model_dir: Path, kind: str) -> dict[str, str]:
    s = engine_settings(model_dir, kind, max_new_tokens=8)
    return {
        "OCRQ_ENGINE__KIND": kind, "OCRQ_ENGINE__MODEL_DIR": str(model_dir), "OCRQ_ENGINE__DTYPE": "float32",
        "OCRQ_ENGINE__MAX_MODEL_LEN": str(s.max_model_len), "OCRQ_ENGINE__MAX_NUM_SEQS": str(s.max_num_seqs),
        "OCRQ_ENGINE__MAX_NUM_BATCHED_TOKENS": str(s.max_num_batched_tokens), "OCRQ_ENGINE__ENFORCE_EAGER": "true",
        "OCRQ_ENGINE__MIN_PIXELS": str(s.min_pixels), "OCRQ_ENGINE__MAX_PIXELS": str(s.max_pixels),
        "OCRQ_ENGINE__MAX_NEW_TOKENS": "8", "OCRQ_BATCH__MODE": "auto", "OCRQ_BATCH__MAX_SIZE": "4",
    }


def _run_job(redis_url: str, tmp_path: Path, job_name: str, engine: str) -> None:
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))
    job = client.submit([str(tmp_path / "in")], job=job_name)
    counts = job.wait(timeout=300)
    assert counts["done"] == 5 and counts["failed"] == 0, counts
    for result in job.results():
        out = result.outputs[0]
        assert out.engine == engine and out.model, out
        assert 1 <= out.meta.get("generated_tokens", 0) <= 8, out.meta


def test_in_process_vllm_engine_in_a_worker(redis_url, start_worker, tmp_path, checkpoint, venv_env):
    word_images(tmp_path / "in", 5)
    # vLLM's engine core in its own process, as on a GPU host: the renderer warms up while it builds
    env = {**venv_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    start_worker(worker_env(redis_url, tmp_path / "store", [tmp_path], **env,
                            **_engine_env(checkpoint, "vllm")), name="inproc")
    _run_job(redis_url, tmp_path, "vllm-inproc", "vllm")
    # the worker's start, phase by phase, with vLLM's own build phases read from its log lines
    client = redis.Redis.from_url(redis_url)
    start = worker_start_state(client, "inproc")
    assert abs(sum(start["phases"].values()) - start["ready_s"]) < 0.01
    detail = start["detail"]
    assert 0 < detail["engine.llm"] <= start["phases"]["engine"], start
    assert "engine.tokenizer" in detail and "engine.renderer_warm" in detail, start
    # vLLM's engine core logged its init (profile, KV cache, warm-up): found in its own log line
    assert 0 < detail["engine.init_engine"] < detail["engine.llm"], start
    # beside the build: the clients, and inside LLM() the renderer's warm-up (core process up);
    # the critical path still adds up to ready
    assert start["beside"]["clients"]["during"] == "engine.llm", start  # once the core builds
    assert start["beside"]["engine.renderer_warm"]["during"] == "engine.llm", start
    assert abs(sum(s for _, s in start["critical_path"]) - start["ready_s"]) < 0.05, start
    assert [name for name, _ in start["critical_path"]][2:4] == ["engine.import", "engine.llm"], start
    # requests entered vLLM through the KV gate at its default over-commit; 5 short pages fit the
    # cache, so vLLM preempted none of them
    [state_key] = list(client.scan_iter(keys.worker_state("inproc@*")))
    state = json.loads(client.get(state_key))
    assert state["kv_gated"] is True and state["engine"]["gate_tokens"] > 0, state
    assert state["engine"]["gate_overcommit"] == DEFAULT_OVERCOMMIT == 1.15, state
    assert state["engine"]["gate_tightened"] == 0 and state.get("preemptions") in (None, 0), state


@pytest.fixture(scope="module")
def server(checkpoint: Path, venv_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_server(checkpoint, venv_env, tmp_path_factory.mktemp("vllm-worker-server")) as url:
        yield url


def test_vllm_server_engine_in_a_worker(redis_url, start_worker, tmp_path, checkpoint, server, venv_env):
    word_images(tmp_path / "in", 5, seed=5)
    env = {**_engine_env(checkpoint, "vllm-server"), "OCRQ_ENGINE__ENDPOINTS": json.dumps([server])}
    start_worker(worker_env(redis_url, tmp_path / "store", [tmp_path], **venv_env, **env))
    _run_job(redis_url, tmp_path, "vllm-server", "vllm-server")
