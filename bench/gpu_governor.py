"""GPU benchmark: HunyuanOCR (full-size random checkpoint) on one GPU capped to a 24 GiB card.

Subcommands (each fits one 10-minute device command; results are JSON files):

- ``decode``: per-decode-step time of HF ``generate`` vs the engine's ``hf`` and ``graph`` modes,
  and token equality (graph vs HF generate at batch 1; batched vs alone in graph mode).
- ``runs``: the mixed workload (≥ 200 images: ~60% 1024×768, 30% 2048×1536, 10% 600×400, one
  shuffled order for every run), exactly 256 new tokens per image (EOS ignored, no repetition
  stop): static batches 1, 4, 8, 16, 32, 64, then the governor (``worker.governor.governor`` +
  ``worker.loop.engine_loop.EngineLoop`` + ``worker.memory.nvml``); plus a batch-size table at 1024×768
  (batch vs peak vs img/s, the shape public HunyuanOCR deployment guides publish).
- ``report``: docs/bench/gpu-governor.{json,md,png} from those files.

Memory is capped with ``torch.cuda.set_per_process_memory_fraction(cap / total)``: allocations
past the cap raise CUDA OOM exactly as on a 24 GiB card. GB in the outputs are GiB (2**30 B).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

GIB = 2**30
SIZES = [((1024, 768), 0.6), ((2048, 1536), 0.3), ((600, 400), 0.1)]


def _images(n: int, seed: int) -> list[Any]:
    """The workload: sizes drawn by the mix, shuffled once by ``seed``; a few noise images per size
    are reused (pixels do not change the cost)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pool = {size: [Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
                   for _ in range(3)] for size, _ in SIZES}
    counts = [round(n * p) for _, p in SIZES]
    counts[0] += n - sum(counts)
    order = [size for (size, _), c in zip(SIZES, counts, strict=True) for _ in range(c)]
    random.Random(seed).shuffle(order)
    return [pool[size][i % 3] for i, size in enumerate(order)]


def _requests(images: list[Any], tokens: int) -> list[Any]:
    from worker.engines.base import OcrRequest

    return [OcrRequest(key=f"img{i}", image=im, task="text", params={"max_new_tokens": tokens})
            for i, im in enumerate(images)]


def _engine(model: Path, decode: str = "graph", dtype: str = "auto") -> Any:
    from ocrq.engine_settings import TransformersSettings
    from worker.engines.transformers.engine import TransformersEngine

    settings = TransformersSettings(kind="transformers", model_dir=model, max_new_tokens=256, repetition_stop=0,
                              max_pixels=2048 * 2048, dtype=dtype, extra={"decode": decode, "ignore_eos": True})
    engine = TransformersEngine(settings)
    engine.start()
    return engine


def _cap(cap_gb: float) -> None:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gb * GIB / total))


def _checkpoint(model: Path) -> Path:
    from worker.checkpoint import make_random_checkpoint

    if not (model / "model.safetensors").exists():
        make_random_checkpoint(model, "full", seed=0, device="cuda")
    return model


class PeakTracker:
    """Engine proxy for the EngineLoop: remembers the largest per-batch peaks (the loop resets the
    peak counter before each batch)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.peak = 0
        self.reserved = 0
        #: per batch: images, wall s, prefill s, decode s, peak allocated GiB (None: it failed)
        self.batches: list[list[Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def note(self) -> None:
        import torch

        self.peak = max(self.peak, torch.cuda.max_memory_allocated())
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved())

    def reset_peak(self) -> None:
        import torch

        self.note()
        torch.cuda.reset_peak_memory_stats()

    def infer(self, batch: Any) -> Any:
        import torch

        t0 = time.perf_counter()
        row: list[Any] = [len(batch), None, None, None, None]
        try:
            outs = self.engine.infer(batch)
            meta = next((o.meta for o in outs if hasattr(o, "meta")), {})
            row[2:4] = [meta.get("prefill_s"), meta.get("decode_s")]
            row[4] = round(torch.cuda.max_memory_allocated() / GIB, 2)
            return outs
        finally:
            row[1] = round(time.perf_counter() - t0, 3)
            self.batches.append(row)
            self.note()


# ------------------------------------------------------------------------------------------------
# runs
# ------------------------------------------------------------------------------------------------


def run_static(engine: Any, reqs: list[Any], batch: int, min_images: int, budget_s: float) -> dict[str, Any]:
    import torch

    from ocrq.errors import EngineOOM, OcrqError

    tracker = PeakTracker(engine)
    torch.cuda.empty_cache()
    tracker.reset_peak()
    tracker.peak = tracker.reserved = 0
    ok = failed = ooms = done = 0
    sizes: list[int] = []
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        try:
            outs = tracker.infer(chunk)
            bad = sum(1 for o in outs if isinstance(o, OcrqError))
            short = sum(1 for o in outs if not isinstance(o, OcrqError) and o.meta["generated_tokens"] != 256)
            ok, failed = ok + len(chunk) - bad, failed + bad
            if short:
                raise RuntimeError(f"{short} images did not generate exactly 256 tokens")
        except EngineOOM:
            ooms, failed = ooms + 1, failed + len(chunk)
            torch.cuda.empty_cache()
        done += len(chunk)
        sizes.append(len(chunk))
        if done >= min_images and time.perf_counter() - t0 > budget_s:
            break
    elapsed = time.perf_counter() - t0
    tracker.note()
    return {"mode": "static", "batch": batch, "images": done, "prefix_only": done < len(reqs),
            "img_per_s": round(ok / elapsed, 3), "elapsed_s": round(elapsed, 2),
            "peak_gb": round(tracker.peak / GIB, 2), "reserved_peak_gb": round(tracker.reserved / GIB, 2),
            "oom_events": ooms, "failed": failed, "batches": tracker.batches}


def run_governor(
    engine: Any, reqs: list[Any], cap_gb: float, snapshot: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The governor as a worker runs it; ``snapshot``: what an earlier worker on this model,
    settings and device saved (a restarted worker loads it from Redis), else a cold start."""
    import torch

    from ocrq.settings import BatchSettings
    from worker.context import governor_for
    from worker.loop.engine_loop import EngineLoop
    from worker.memory.nvml import NvmlProbe

    tracker = PeakTracker(engine)
    torch.cuda.empty_cache()
    tracker.reset_peak()
    tracker.peak = tracker.reserved = 0
    settings = BatchSettings(mode="auto", max_size=128, headroom=0.10, memory_cap_bytes=int(cap_gb * GIB))
    probe = NvmlProbe.for_current_device()
    governor = governor_for(settings, tracker, probe)
    if snapshot is not None:
        governor.restore(json.loads(json.dumps(snapshot)))  # as it travels through Redis
    loop = EngineLoop(tracker, governor, probe, linger_s=0.02, oom_retries=3)
    t0 = time.perf_counter()
    loop.start()
    futures = loop.submit_many(reqs)
    ok = failed = 0
    tokens_ok = True
    for f in futures:
        exc = f.exception()
        if exc is None:
            ok += 1
            tokens_ok &= f.result().meta.get("generated_tokens") == 256
        else:
            failed += 1
    elapsed = time.perf_counter() - t0
    state = loop.state()
    loop.stop()
    tracker.note()
    return {"mode": "governor", "batch": None, "start": "warm" if snapshot else "cold",
            "images": len(reqs), "prefix_only": False,
            "img_per_s": round(ok / elapsed, 3), "elapsed_s": round(elapsed, 2),
            "peak_gb": round(tracker.peak / GIB, 2), "reserved_peak_gb": round(tracker.reserved / GIB, 2),
            "oom_events": int(state.get("oom_events", 0)), "failed": failed, "all_256_tokens": tokens_ok,
            "governor_state": json.loads(json.dumps(state, default=str)), "batches": tracker.batches,
            "snapshot": governor.snapshot()}


def run_generate(engine: Any, reqs: list[Any], batch: int, min_images: int, budget_s: float) -> dict[str, Any]:
    """A hand-rolled script, as public HunyuanOCR examples run the model: the HF processor on the CPU, then
    ``model.generate`` (greedy, repetition penalty, exactly 256 new tokens) on static batches of
    ``batch``, in arrival order. Same checkpoint, cap and images as the other runs."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    penalty = engine.sampling.repetition_penalty
    done = 0
    rows: list[list[Any]] = []
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        t1 = time.perf_counter()
        enc = engine.processor(text=[engine._prompt_text(r) for r in chunk], images=[r.image for r in chunk],
                               padding=True, padding_side="left", return_tensors="pt").to(engine.device)
        enc["pixel_values"] = enc["pixel_values"].to(engine.model.dtype)
        with torch.inference_mode():
            out = engine.model.generate(**enc, max_new_tokens=256, min_new_tokens=256, do_sample=False,
                                        repetition_penalty=penalty)
        new = out.shape[1] - enc["input_ids"].shape[1]
        if new != 256:
            raise RuntimeError(f"generate made {new} new tokens, not 256")
        done += len(chunk)
        rows.append([len(chunk), round(time.perf_counter() - t1, 3)])
        if done >= min_images and time.perf_counter() - t0 > budget_s:
            break
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return {"mode": "hf_generate", "batch": batch, "images": done, "prefix_only": done < len(reqs),
            "img_per_s": round(done / elapsed, 3), "elapsed_s": round(elapsed, 2), "peak_gb": round(peak / GIB, 2),
            "oom_events": 0, "failed": 0,  # by construction: an OOM or a short output ends the command
            "batches": rows}


def seeds_table(engine: Any, batches: list[int]) -> list[dict[str, Any]]:
    """1024×768 only, one batch per size after a warm-up: batch vs peak vs img/s."""
    import torch

    from ocrq.errors import EngineOOM

    reqs = _requests([im for im in _images(64, 7) if im.size == (1024, 768)] * 2, 256)
    rows: list[dict[str, Any]] = []
    engine.infer(reqs[:1])
    for b in batches:
        torch.cuda.empty_cache()
        engine.reset_peak()
        t0 = time.perf_counter()
        try:
            engine.infer(reqs[:b])
            dt = time.perf_counter() - t0
            rows.append({"batch": b, "peak_gb": round(torch.cuda.max_memory_allocated() / GIB, 2),
                         "img_per_s": round(b / dt, 3), "oom": False})
        except EngineOOM:
            rows.append({"batch": b, "peak_gb": None, "img_per_s": None, "oom": True})
    return rows


# ------------------------------------------------------------------------------------------------
# decode-step timing and equivalence
# ------------------------------------------------------------------------------------------------


def _hf_generate_step_ms(engine: Any, reqs: list[Any], n: int) -> float:
    import torch

    texts = [engine._prompt_text(r) for r in reqs]
    enc = engine.processor(text=texts, images=[r.image for r in reqs], padding=True, padding_side="left",
                           return_tensors="pt").to(engine.device)
    enc["pixel_values"] = enc["pixel_values"].to(engine.model.dtype)
    times = []
    for new in (1, n + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            engine.model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return (times[1] - times[0]) / n * 1e3


def _engine_step_ms(engine: Any, reqs: list[Any], mode: str, n: int) -> float:
    texts = [engine._prompt_text(r) for r in reqs]
    _, info = engine._generate(reqs, texts, max_new=n + 1, stops=False, decode=mode)
    return float(info["decode_s"]) / n * 1e3


def _tokens(engine: Any, reqs: list[Any], mode: str, n: int) -> list[list[int]]:
    texts = [engine._prompt_text(r) for r in reqs]
    rows, _ = engine._generate(reqs, texts, max_new=n, stops=False, decode=mode)
    return [r.tokens for r in rows]


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def decode_bench(engine: Any, steps: int) -> dict[str, Any]:

    big = _requests(_images(64, 3), steps)
    same = [r for r in big if r.image.size == (1024, 768)]
    result: dict[str, Any] = {"step_ms": []}
    for b in (1, 8, 16, 32, 64):
        reqs = (same * 64)[:b]
        row: dict[str, Any] = {"batch": b}
        for mode in ("graph", "hf"):
            _engine_step_ms(engine, reqs, mode, 4)  # warm-up (kernels, allocator)
            row[f"engine_{mode}_ms"] = round(_engine_step_ms(engine, reqs, mode, steps), 3)
        if b in (1, 64):
            row["hf_generate_ms"] = round(_hf_generate_step_ms(engine, reqs, 32), 3)
        result["step_ms"].append(row)
        print(row, flush=True)
    result["vs_generate_batch1"] = vs_generate(engine, big)
    mixed = mixed_requests()
    return {**result, **invariance(engine, mixed, ("graph", "hf"))}


def vs_generate(engine: Any, big: list[Any]) -> list[dict[str, Any]]:
    """Equivalence: HF generate (its own positions; batch 1, so no cross-row effects) vs the engine."""
    import torch

    singles = [next(r for r in big if r.image.size == s) for s, _ in SIZES]
    gen_match = []
    penalty = engine.sampling.repetition_penalty
    for r in singles:
        enc = engine._encode([r], [engine._prompt_text(r)])
        kw = {k: enc[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw",
                                  "mm_token_type_ids")}
        with torch.inference_mode():
            out = engine.model.generate(**kw, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                        repetition_penalty=penalty)
        ref = out[0, enc["input_ids"].shape[1]:].tolist()
        mine = {m: _tokens(engine, [r], m, 64)[0] for m in ("graph", "hf")}
        gen_match.append({"size": list(r.image.size), "graph_equal": mine["graph"] == ref,
                          "hf_equal": mine["hf"] == ref,
                          "first_diff": _first_diff(mine["graph"], ref),
                          "distinct_tokens": len(set(ref))})
    return gen_match


def mixed_requests() -> list[Any]:
    big = _requests(_images(64, 3), 64)
    same = [r for r in big if r.image.size == (1024, 768)]
    return [next(r for r in big if r.image.size == s) for s, _ in SIZES] + same[1:6]


def invariance(engine: Any, mixed: list[Any], modes: tuple[str, ...]) -> dict[str, Any]:
    """On the GPU (engine dtype): tokens and top-5 logprobs of each image alone vs in one mixed batch, per
    decode mode (HF's own path included, as the yardstick), and graph vs hf on the same batch."""
    result: dict[str, Any] = {}
    lps = {}
    for mode in modes:
        alone = [_tokens(engine, [r], mode, 64)[0] for r in mixed]
        together = _tokens(engine, mixed, mode, 64)
        lp_alone = [engine.topk_logprobs([r], 5, 16, decode=mode)[0] for r in mixed]
        lps[mode] = engine.topk_logprobs(mixed, 5, 16, decode=mode)
        result[f"batch_invariance_{mode}"] = {
            "images": len(mixed), "equal_rows": sum(a == b for a, b in zip(alone, together, strict=True)),
            "first_diffs": [_first_diff(a, b) for a, b in zip(alone, together, strict=True)],
            "top5_max_abs_logprob_diff": _lp_diff(lp_alone, lps[mode])}
    if "graph" in lps and "hf" in lps:
        result["graph_vs_hf_top5_max_abs_logprob_diff"] = _lp_diff(lps["graph"], lps["hf"])
    return result


def _lp_diff(a: list[Any], b: list[Any]) -> float:
    """Largest |logprob difference| over tokens both top-5 lists share, all rows and steps."""
    return max(
        (abs(x[1] - y[1]) for ra, rb in zip(a, b, strict=True) for sa, sb in zip(ra, rb, strict=True)
         for x in sa for y in sb if x[0] == y[0]), default=0.0)


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------


def report(runs_path: Path, decode_path: Path | None, out_dir: Path) -> None:
    data = json.loads(runs_path.read_text())
    if decode_path is not None and decode_path.exists():
        data["decode"] = json.loads(decode_path.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu-governor.json").write_text(json.dumps(data, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = data["runs"]
    labels = [f"static {r['batch']}" if r["mode"] == "static" else f"governor ({r.get('start', 'cold')})"
              for r in runs]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["C0" if r["failed"] == 0 else "C3" for r in runs]
    ax[0].bar(labels, [r["img_per_s"] for r in runs], color=colors)
    ax[0].set_ylabel("images/s (successful)")
    ax[0].set_title(f"mixed workload, 256 tokens, cap {data['cap_gb']} GiB")
    ax[1].bar(labels, [r["peak_gb"] for r in runs], color="C1")
    ax[1].axhline(data["cap_gb"], color="k", ls="--", label="cap")
    ax[1].set_ylabel("peak allocated (GiB)")
    ax[1].legend()
    for a in ax:
        a.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(out_dir / "gpu-governor.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["decode", "invariance", "parity", "runs", "report"])
    ap.add_argument("--dtype", default="auto", help="engine dtype (parity: float32 separates rounding from bugs)")
    ap.add_argument("--decode", default="graph", help="engine decode mode: graph | hf (HF forward per step)")
    ap.add_argument("--budget-upto", type=int, default=4, help="static batches up to this size stop at --budget-s")
    ap.add_argument("--model", type=Path, default=Path("/tmp/hunyuan-full"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cap-gb", type=float, default=24.0)
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batches", default="1,4,8,16,32,64")
    ap.add_argument("--budget-s", type=float, default=40.0, help="static 1/4 stop after this, prefix ≥ 16")
    ap.add_argument("--governor", action="store_true")
    ap.add_argument("--static", default="engine", choices=["engine", "generate"],
                    help="static rows through the engine, or as a hand-rolled script (HF processor + generate)")
    ap.add_argument("--no-seeds", dest="seeds", action="store_false", help="skip the 1024x768 seeds table")
    ap.add_argument("--decode-json", type=Path)
    args = ap.parse_args()
    if args.command == "report":
        report(args.out / "runs.json", args.decode_json, args.out)
        return
    from worker.engines.transformers.engine import ALLOC_CONF

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)  # as the engine does; before CUDA starts
    _checkpoint(args.model)
    _cap(args.cap_gb)
    engine = _engine(args.model, decode=args.decode, dtype=args.dtype)
    if args.command == "parity":
        parity = {"dtype": args.dtype, "vs_generate_batch1": vs_generate(engine, _requests(_images(64, 3), 64)),
                  **invariance(engine, mixed_requests(), ("graph", "hf"))}
        args.out.write_text(json.dumps(parity, indent=2))
        print(json.dumps(parity), flush=True)
        return
    if args.command == "invariance":
        args.out.write_text(json.dumps(invariance(engine, mixed_requests(), ("graph", "hf")), indent=2))
        return
    if args.command == "decode":
        args.out.write_text(json.dumps(decode_bench(engine, 64), indent=2))
        return
    reqs = _requests(_images(args.images, args.seed), 256)
    engine.infer(reqs[:2])  # warm-up
    result: dict[str, Any] = {"cap_gb": args.cap_gb, "images": args.images, "seed": args.seed,
                              "new_tokens": 256, "decode": engine.decode_mode,
                              "prefill_tokens": engine.settings.max_num_batched_tokens,
                              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "runs": []}
    if args.governor:  # first: it is the run the table exists for, should the command be cut short
        snapshot = None
        for _ in ("cold", "warm"):  # warm: a restarted worker, continuing from the cold run's snapshot
            run = run_governor(engine, reqs, args.cap_gb, snapshot)
            snapshot = run.pop("snapshot")
            result["runs"].append(run)
            print({k: v for k, v in run.items() if k != "governor_state"}, flush=True)
            args.out.write_text(json.dumps(result, indent=2))
    for b in [int(x) for x in args.batches.split(",") if x]:
        budget = args.budget_s if b <= args.budget_upto else 1e9
        run_fixed = run_generate if args.static == "generate" else run_static
        result["runs"].append(run_fixed(engine, reqs, b, 16, budget))
        print(result["runs"][-1], flush=True)
        args.out.write_text(json.dumps(result, indent=2))
    if args.seeds:
        result["seeds_1024x768"] = seeds_table(engine, [1, 2, 4, 8, 16, 32, 64])
        print(result["seeds_1024x768"], flush=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
