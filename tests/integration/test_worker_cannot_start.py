"""A worker whose engine cannot be built stops with the reason instead of consuming without one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import worker_env

pytestmark = pytest.mark.integration


def test_a_worker_whose_engine_cannot_be_built_exits_1_naming_why(redis_url: str, tmp_path: Path) -> None:
    empty_model = tmp_path / "model"
    empty_model.mkdir()
    env = worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_ENGINE__KIND="transformers",
                     OCRQ_ENGINE__MODEL_DIR=str(empty_model))
    proc = subprocess.run([sys.executable, "-m", "ocrq_cli", "worker", "--name", "broken@%h"], env=env,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "worker cannot start" in out and str(empty_model) in out, out[-3000:]
    assert not any(line.endswith(" ready.") for line in out.splitlines()), out[-3000:]
