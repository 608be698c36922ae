"""Fixtures shared by the GPU tests (run on an H200 by bench/h200_vllm.sh, never in CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The full-size random HunyuanOCR-1.5 checkpoint (reused from OCRQ_FULL_CHECKPOINT when there)."""
    from worker.checkpoint import make_random_checkpoint

    cached = Path(os.environ.get("OCRQ_FULL_CHECKPOINT", "/tmp/hunyuan-full"))
    if (cached / "model.safetensors").exists():
        return cached
    return make_random_checkpoint(tmp_path_factory.mktemp("full"), "full", device="cuda")
