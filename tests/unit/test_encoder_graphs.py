"""``worker.engines.vllm.encoder_graphs``: the budgets and the settings that turn vLLM's encoder
CUDA graphs on (pure; the protocol itself runs in the vllm tier and on the H200)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ocrq.engine_settings import VllmServerSettings, VllmSettings
from worker.engines.vllm import launcher
from worker.engines.vllm.encoder_graphs import BUDGET_STEP, PATCHES_PER_TOKEN, budgets, page_tokens
from worker.engines.vllm.options import compilation_config


def test_a_pages_tokens_are_its_merged_rows_with_a_newline_each_plus_begin_and_end() -> None:
    assert page_tokens(48, 64) == 24 * 33 + 2  # 1024×768
    assert page_tokens(96, 128) == 3122  # 2048×1536
    assert page_tokens(32, 32) == 274  # 512×512, HunyuanOCR's min_pixels


@pytest.mark.parametrize(("max_pixels", "max_model_len"), [(2048 * 2048, 4096), (2048 * 2048, 8192),
                                                           (1024 * 1024, 8192), (512 * 512, 4096)])
def test_budgets_cover_every_page_up_to_max_pixels_in_small_steps(max_pixels: int, max_model_len: int) -> None:
    got = budgets(max_pixels, max_model_len)
    assert got == sorted(set(got)) and got[-1] <= max_model_len
    side = math.isqrt(max_pixels) // 32
    assert got[-1] == min(side * (side + 1) + 2, max_model_len)  # the square page of max_pixels fits
    assert all(b / a <= BUDGET_STEP * 1.05 for a, b in zip(got, got[1:], strict=False))  # ≤ ~10 % padding
    for h in range(2, 2 * side + 1, 2):  # every page that fits the largest budget has its rows in a graph
        for w in (h, 2 * side - h + 2):
            t = page_tokens(h, w)
            if t <= got[-1]:
                fit = min(b for b in got if b >= t)
                assert h * w <= PATCHES_PER_TOKEN * fit


def test_graphs_only_where_asked_for_on_cuda_and_not_eager(caplog: pytest.LogCaptureFixture) -> None:
    on = VllmSettings(kind="vllm", vision_cuda_graphs=True, max_model_len=4096)
    cc = compilation_config(on, on_cuda=True)
    assert cc is not None and cc["cudagraph_mm_encoder"] is True
    assert cc["encoder_cudagraph_max_vision_items_per_batch"] == 1  # a page's graph from its own size
    assert cc["encoder_cudagraph_token_budgets"] == budgets(on.max_pixels, 4096)
    assert compilation_config(on, on_cuda=False) is None
    assert compilation_config(on.model_copy(update={"enforce_eager": True}), on_cuda=True) is None
    said = [r.getMessage() for r in caplog.records]  # asked for and not possible: said, not silent
    assert said == ["engine.vision_cuda_graphs is ignored: no CUDA device",
                    "engine.vision_cuda_graphs is ignored: enforce_eager is set"]
    assert compilation_config(VllmSettings(kind="vllm"), on_cuda=True) is None  # off by default


def test_a_launched_server_gets_the_same_compilation_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_has_cuda", lambda: True)
    s = VllmServerSettings(kind="vllm-server", vision_cuda_graphs=True)
    argv = launcher.server_argv(tmp_path, 8000, s)
    assert json.loads(argv[argv.index("--compilation-config") + 1]) == compilation_config(s, on_cuda=True)
    assert "--compilation-config" not in launcher.server_argv(tmp_path, 8000, VllmServerSettings(kind="vllm-server"))
