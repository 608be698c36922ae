"""Summarise a py-spy raw profile (``--format raw``, as ``bench.overhead --profile`` writes):
share of samples per function, self and inclusive (docs/bench/overhead.md quotes these).

    .venv/bin/python -m bench.profile_summary PROFILE.txt [--top 25]
    .venv/bin/python -m bench.profile_summary CORE.txt --engine-core   # vLLM engine core, by phase

``--engine-core`` reads a record of vLLM's engine core taken with ``--idle`` (bench/h200_vllm.sh DIAG)
and splits its main thread (every stack not rooted in a ``threading`` thread) into the phases
docs/bench/gpu-vllm.md tabulates; a sample goes to the first phase whose test matches.
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

_FRAME = re.compile(r"(.*) \((.*?)(?::\d+)?\)$")


def _name(frame: str) -> str:
    m = _FRAME.match(frame)
    return f"{m.group(1)} ({m.group(2).rsplit('/', 1)[-1]})" if m else frame


def _samples(path: Path) -> Iterator[tuple[list[str], int]]:
    """(raw frames, root first; samples) per line of a raw py-spy profile (gzipped if ``.gz``)."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for line in text.splitlines():
        if line.strip():
            stack, _, n = line.rpartition(" ")
            yield stack.split(";"), int(n)


def summarize(path: Path) -> tuple[int, Counter[str], Counter[str]]:
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for frames, count in _samples(path):
        total += count
        names = [_name(f) for f in frames]
        own[names[-1]] += count
        for name in set(names):
            incl[name] += count
    return total, own, incl


# (phase, test on the sample's frame names and its raw leaf frame), first match wins; line 528 of
# hunyuan_vision.py is vLLM 0.26.0's one sync in the tower (`split_lengths = (...).tolist()`)
_PHASES: list[tuple[str, Callable[[set[str], str], bool]]] = [
    (
        "idle: waiting for requests",
        lambda s, leaf: (
            "EngineCoreProc._process_input_queue" in s and leaf.startswith(("Condition.wait", "Event.wait"))
        ),
    ),
    (
        "vision tower: waiting for the GPU (.tolist after the last layer)",
        lambda s, leaf: leaf.startswith("HunYuanVisionTransformer.forward") and "hunyuan_vision.py:528" in leaf,
    ),
    ("vision tower: launching (per image, per layer)", lambda s, leaf: "HunYuanVisionTransformer.forward" in s),
    # ocrq's encoder CUDA graphs (engine.vision_cuda_graphs, worker/engines/vllm/encoder_graphs.py):
    # the one copy from host memory per page, then the rest (buffers, replay, the patch merger)
    ("vision tower, CUDA graphs: copying page boundaries", lambda s, leaf: "_pad_cu_seqlens" in s),
    ("vision tower, CUDA graphs: buffers, replay, merger", lambda s, leaf: "EncoderCudaGraphManager.execute" in s),
    # ocrq's grouped tower (engine.vision_group_patches, worker/engines/vllm/vision.py)
    ("vision tower, grouped: layers on groups of pages", lambda s, leaf: "_grouped" in s),
    (
        "batching multimodal inputs (pixel patches into one buffer)",
        lambda s, leaf: "MultiModalFlatField._reduce_data" in s,
    ),
    ("sampling", lambda s, leaf: "UniProcExecutor.sample_tokens" in s),
    ("execute_model, the rest (decoder inputs and graphs)", lambda s, leaf: "GPUModelRunner.execute_model" in s),
    ("scheduler", lambda s, leaf: "Scheduler.schedule" in s or "Scheduler.update_from_output" in s),
    ("busy loop, other", lambda s, leaf: "EngineCoreProc.run_busy_loop" in s),
    ("truncated stacks", lambda s, leaf: True),
]


def engine_core_phases(path: Path) -> tuple[int, Counter[str]]:
    phases: Counter[str] = Counter()
    total = 0
    for frames, count in _samples(path):
        if frames[0].startswith("Thread._bootstrap"):
            continue  # vLLM's socket threads, tqdm's monitor: not the busy loop
        names = {_name(f).split(" (")[0] for f in frames}
        total += count
        phases[next(p for p, test in _PHASES if test(names, frames[-1]))] += count
    return total, phases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("profile", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--engine-core", action="store_true", help="vLLM engine core's main thread, by phase")
    args = ap.parse_args()
    if args.engine_core:
        total, phases = engine_core_phases(args.profile)
        print(f"{args.profile}: {total} main-thread samples")
        for name, n in phases.most_common():
            print(f"{100 * n / total:5.1f}%  {n:5d}  {name}")
        return
    total, own, incl = summarize(args.profile)
    print(f"{args.profile}: {total} samples")
    for title, counter in (("self", own), ("inclusive", incl)):
        print(f"--- {title}")
        for name, n in counter.most_common(args.top):
            print(f"{100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
