"""Where a transformers-engine batch spends its time on the GPU (torch.profiler, one JSON).

- ``prefill``: one mixed micro-batch's ``_encode`` (CPU resize + device normalise) and chunked
  prefill (vision tower + text), split into wall time, host time in ``_encode`` and the CUDA
  kernels by name;
- ``decode``: one eager ``StaticDecoder.step`` at a few batch sizes (kernels per step and their
  summed device time) next to the replayed CUDA graph's wall time per step.

    python3 -m bench.profile_engine --out OUT/profile.json      # on the GPU
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def _kernels(prof: Any, top: int = 15) -> dict[str, Any]:
    by_name: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            by_name[ev.name].append(ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total)
    total = sum(sum(v) for v in by_name.values())
    rows = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)[:top]
    return {"kernels": sum(len(v) for v in by_name.values()), "device_ms": round(total / 1e3, 3),
            "top": [{"ms": round(t / 1e3, 3), "n": n, "name": k[:120]} for t, n, k in rows]}


def _per_call_ms(fn: Any, n: int) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def profile_prefill(engine: Any, reqs: list[Any]) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from worker.engines.transformers.prefill import prefill

    texts = [engine._prompt_text(r) for r in reqs]
    out: dict[str, Any] = {"batch": len(reqs), "sizes": [r.image.size for r in reqs]}
    for attempt in ("warm", "timed"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            enc = engine._encode(reqs, texts)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            if attempt == "timed":
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    prefill(engine.model, enc, engine.settings.max_num_batched_tokens, None)
                    torch.cuda.synchronize()
            else:
                prefill(engine.model, enc, engine.settings.max_num_batched_tokens, None)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
        del enc
    out.update({"encode_s": round(t1 - t0, 4), "prefill_s_profiled": round(t2 - t1, 4)})
    # the same prefill unprofiled, for its real wall time
    with torch.inference_mode():
        enc = engine._encode(reqs, texts)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prefill(engine.model, enc, engine.settings.max_num_batched_tokens, None)
        torch.cuda.synchronize()
        out["prefill_s"] = round(time.perf_counter() - t0, 4)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.model.get_image_features(enc["pixel_values"], enc["image_grid_thw"])
        torch.cuda.synchronize()
        out["vision_tower_s"] = round(time.perf_counter() - t0, 4)
    out.update(_kernels(prof))
    return out


def profile_decode(engine: Any, reqs: list[Any], batch: int, steps: int) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from worker.engines.transformers.prefill import prefill
    from worker.engines.transformers.static_decode import StaticDecoder

    reqs = (reqs * batch)[:batch]
    texts = [engine._prompt_text(r) for r in reqs]
    with torch.inference_mode():
        enc = engine._encode(reqs, texts)
        ids, mask, pos = enc["input_ids"], enc["attention_mask"], enc["position_ids"]
        dec = StaticDecoder(engine.model, batch, ids.shape[1], steps + 8, repetition_penalty=1.08)
        dec.seed_seen(ids, mask)
        logits, _ = prefill(engine.model, enc, engine.settings.max_num_batched_tokens, dec)
        dec.select(logits)
        dec.finish_prefill(mask, pos.amax(dim=(0, 2)) + 1)
        dec.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec.step()
            torch.cuda.synchronize()
        eager_ms = _per_call_ms(dec.step, steps // 2)
        dec.capture()
        dec.advance()
        graph_ms = _per_call_ms(dec.advance, steps // 2)
        dec.release()
    return {"batch": batch, "prompt_len": int(ids.shape[1]), "eager_step_ms": round(eager_ms, 3),
            "graph_step_ms": round(graph_ms, 3), **_kernels(prof, 20)}


def main() -> None:
    from bench.gpu_governor import _cap, _checkpoint, _engine, _images, _requests

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=Path("/tmp/ocrq-bench/hunyuan-full"))
    ap.add_argument("--cap-gb", type=float, default=24.0)
    ap.add_argument("--batches", default="1,8,32,64")
    args = ap.parse_args()
    _cap(args.cap_gb)
    engine = _engine(_checkpoint(args.model))
    reqs = _requests(_images(200, 1234), 256)
    result: dict[str, Any] = {"prefill": profile_prefill(engine, reqs[:16])}
    print(json.dumps(result["prefill"])[:3000], flush=True)
    same = [r for r in reqs if r.image.size == (1024, 768)]
    result["decode"] = []
    for b in (int(x) for x in args.batches.split(",")):
        row = profile_decode(engine, same, b, 64)
        result["decode"].append(row)
        print(json.dumps(row)[:3000], flush=True)
        args.out.write_text(json.dumps(result, indent=2))
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
