"""Each model engine inside a real `ocrq worker` process, end to end through Redis, with the
tiny random-weight HunyuanOCR checkpoint built by `ocrq model make-random` (text is gibberish
with random weights: these tests check the plumbing, token counts and per-image records)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from producer.client import Client
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    done = subprocess.run([sys.executable, "-m", "ocrq_cli", "model", "make-random", "--size", "tiny",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    return out


def test_transformers_engine_in_a_worker(redis_url, start_worker, tmp_path, tiny_checkpoint):
    src = tmp_path / "in"
    word_images(src, 5)
    env = worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_ENGINE__KIND="transformers",
                     OCRQ_ENGINE__MODEL_DIR=str(tiny_checkpoint), OCRQ_ENGINE__MAX_NEW_TOKENS="8",
                     OCRQ_BATCH__MODE="auto", OCRQ_BATCH__MAX_SIZE="4")
    start_worker(env)
    client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))
    job = client.submit([str(src)], job="hf")
    counts = job.wait(timeout=300)
    assert counts["done"] == 5 and counts["failed"] == 0, counts
    for result in job.results():
        out = result.outputs[0]
        assert out.engine == "transformers" and out.model
        assert 1 <= out.meta["generated_tokens"] <= 8, out.meta
        assert (out.width, out.height) == (900, 300)
