"""The generated parts of the docs (``python -m bench report``, bench/report.py): their markers,
the tables made from a run's JSON, and rebuilding a document's parts. Imports no benchmark: a
benchmark that writes its own page or table (bench.scale, bench.gpu_vllm_report) uses it, and
the driver above them both renders what they make.

A generated part of a document sits between two markers; the rest of the document is prose and
stays as written::

    <!-- bench:report NAME SOURCE -->
    ...what a renderer makes of SOURCE (a JSON file, relative to the document; for a folder
    renderer, a folder of a run's raw rows)...
    <!-- /bench:report -->
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

BLOCK = re.compile(r"(<!-- bench:report (?P<name>[\w-]+) (?P<source>\S+) -->\n)(?P<body>.*?)(<!-- /bench:report -->)",
                   re.DOTALL)


def _half_up(v: float, places: int) -> str:
    """Rounded as written by hand (2.485 -> 2.49), not as the float's binary value rounds (2.48)."""
    return str(Decimal(str(v)).quantize(Decimal(1).scaleb(-places), ROUND_HALF_UP))


def _cell(v: Any) -> str:
    return "-" if v is None else str(v)


def gpu_vllm(doc: dict[str, Any]) -> str:
    """docs/bench/gpu-vllm.md's row table; "× plain" against the best plain (vllm-*) row of the same budget."""
    runs = doc["runs"]
    best: dict[float, float] = {}
    for r in runs:
        if r["name"].startswith("vllm-"):
            best[r["cap_gb"]] = max(best.get(r["cap_gb"], 0.0), r["img_per_s"])
    lines = ["| row | budget GiB | max_num_batched_tokens | img/s | first set img/s | × plain, same budget | failed "
             "| preemptions | device GiB | third set img/s | small job: first / all (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ref = best.get(r["cap_gb"])
        ratio = f"{r['img_per_s'] / ref:.2f}" if ref else "-"
        small = (f"{r['small_first_result_s']} / {r['small_done_s']}"
                 if r.get("small_first_result_s") is not None else "-")
        lines.append(f"| `{r['name']}` | {r['cap_gb']:g} | {_cell(r['max_num_batched_tokens'])} | "
                     f"{r['img_per_s']:.2f} | {_cell(r['first_img_per_s'])} | {ratio} | {r['failed']} | "
                     f"{_cell(r['preemptions'])} | {_cell(r['peak_gb'])} | {_cell(r.get('third_img_per_s'))} | "
                     f"{small} |")
    return "\n".join(lines)


def gpu_governor_runs(doc: dict[str, Any]) -> str:
    """docs/bench/gpu-governor.md's mixed workload: governor runs (warm first), then static batches."""
    runs = doc["runs"]
    governor = sorted((r for r in runs if r["mode"] == "governor"), key=lambda r: r.get("start") != "warm")
    static = sorted((r for r in runs if r["mode"] == "static"), key=lambda r: r["batch"])
    best = max(r["img_per_s"] for r in runs)
    lines = ["| run | images | img/s | peak GB (allocated) | reserved GB | OOM events | failed | batches |",
             "|---|---|---|---|---|---|---|---|"]
    for r in [*governor, *static]:
        bold = "**" if r["img_per_s"] == best else ""
        name = f"governor, {r['start']}" if r["mode"] == "governor" else f"static {r['batch']}"
        images = f"{r['images']} (prefix)" if r["prefix_only"] else str(r["images"])
        batches = ", ".join(str(b[0]) for b in r["batches"]) if r["mode"] == "governor" else ""
        lines.append(f"| {bold}{name}{bold} | {images} | {bold}{r['img_per_s']:.2f}{bold} | {r['peak_gb']:.2f} | "
                     f"{r['reserved_peak_gb']:.2f} | {r['oom_events']} | {r['failed']} | {batches}".rstrip() + " |")
    return "\n".join(lines)


def gpu_governor_batches(doc: dict[str, Any]) -> str:
    """docs/bench/gpu-governor.md's batch-size table (1024×768 only, one batch each)."""
    rows = doc["seeds_1024x768"]
    return "\n".join([
        "| batch | " + " | ".join(str(r["batch"]) for r in rows) + " |",
        "|---" * (len(rows) + 1) + "|",
        "| peak GB | " + " | ".join("OOM" if r["oom"] else f"{r['peak_gb']:.2f}" for r in rows) + " |",
        "| img/s | " + " | ".join("-" if r["oom"] else f"{r['img_per_s']:.2f}" for r in rows) + " |",
    ])


def gpu_governor_decode(doc: dict[str, Any]) -> str:
    """docs/bench/gpu-governor.md's decode step times, beside the step before the lean one; the
    largest batch's graph step in bold (the target is set at batch 64)."""
    rows = doc["decode_step_ms"]["rows"]
    before = {r["batch"]: r for r in doc["earlier_run_before_lean_decode_step"]["decode_step_ms"]["rows"]}
    last = rows[-1]["batch"]
    lines = ["| batch | HF `generate` | engine `hf` mode (HF forward per step) | engine `graph` mode "
             "| `graph` before the lean step |",
             "|---|---|---|---|---|"]
    for r in rows:
        hf_generate = f"{_half_up(r['hf_generate_ms'], 1)} ms" if "hf_generate_ms" in r else "–"
        graph = f"{_half_up(r['engine_graph_ms'], 2)} ms"
        lines.append(f"| {r['batch']} | {hf_generate} | {_half_up(r['engine_hf_ms'], 1)} ms | "
                     f"{f'**{graph}**' if r['batch'] == last else graph} | "
                     f"{_half_up(before[r['batch']]['engine_graph_ms'], 2)} ms |")
    return "\n".join(lines)


def gpu_worker(doc: dict[str, Any]) -> str:
    """docs/bench/gpu-worker.md's first table: the cold and the warm job through a real worker."""
    best = max(j["img_per_s"] for j in doc["jobs"])
    lines = ["| job | images | done | failed | wall (submit → all stored) | img/s | batches | largest batch "
             "| governor peak | calibration error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for j in doc["jobs"]:
        state = j["worker_state"]
        restored = state.get("restored_observations") or 0
        name = f"{j['start']} (restored {restored} batches)" if restored else j["start"]
        rate = f"**{j['img_per_s']:.2f}**" if j["img_per_s"] == best else f"{j['img_per_s']:.2f}"
        lines.append(f"| {name} | {j['images']} | {j['done']} | {j['failed']} | {j['elapsed_s']:.1f} s | {rate} | "
                     f"{state['batches']} | {max(j['batch_sizes'])} | {j['max_measured_peak_gb']:.2f} GiB | "
                     f"{state['calibration_error'] * 100:.1f}% |")
    return "\n".join(lines)


def gpu_multi(doc: dict[str, Any]) -> str:
    """docs/bench/gpu-multi.md's table: the warm-up, then one worker, then two, on one queue."""
    lines = ["| job | workers | images | failed | wall | img/s | per worker | batches | peak (simulated) |",
             "|---|---|---|---|---|---|---|---|---|"]
    before: dict[str, int] = {}  # a worker's batch count is cumulative over its jobs (until it restarts)
    for j in doc["jobs"]:
        kind = j["job"].rsplit("-", 1)[-1]
        workers = sorted(j["per_worker_images"])
        states = [j["worker_state"][w] for w in workers]
        batches = []
        for w, st in zip(workers, states, strict=True):
            carried = st["images"] > j["per_worker_images"][w]  # the same process as the job before
            batches.append(str(st["batches"] - (before.get(w, 0) if carried else 0)))
            before[w] = st["batches"]
        peaks = {f"{st['max_measured_peak_bytes'] / 2**30:.1f}" for st in states}
        peak = f"{peaks.pop()} GiB" + (" each" if len(states) > 1 else "") if len(peaks) == 1 else \
            " / ".join(f"{st['max_measured_peak_bytes'] / 2**30:.1f} GiB" for st in states)
        timed = kind != "warmup"
        rate = f"**{j['img_per_s']:.2f}**" if timed else f"{j['img_per_s']:.2f}"
        per_worker = " / ".join(str(j["per_worker_images"][w]) for w in workers)
        lines.append(f"| {f'`{kind}`' if timed else 'warm-up (untimed)'} | "
                     f"{' + '.join(w.split('@')[0] for w in workers)} | {j['images']} | {j['failed']} | "
                     f"{j['elapsed_s']:.1f} s | {rate} | {per_worker} | {' / '.join(batches)} | {peak} |")
    return "\n".join(lines)


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "gpu-vllm": gpu_vllm,
    "gpu-governor-runs": gpu_governor_runs,
    "gpu-governor-batches": gpu_governor_batches,
    "gpu-governor-decode": gpu_governor_decode,
    "gpu-worker": gpu_worker,
    "gpu-multi": gpu_multi,
}


def render_table(name: str, source: Path) -> str:
    """The table ``RENDERERS[name]`` makes of the JSON ``source``."""
    if name not in RENDERERS:
        raise KeyError(f"no renderer {name!r} (bench/report_tables.py RENDERERS, bench/report.py)")
    return RENDERERS[name](json.loads(source.read_text()))


def rebuild(text: str, doc_dir: Path, only: str | None = None,
            render: Callable[[str, Path], str] = render_table) -> str:
    """text with its generated parts rebuilt (only: those of that renderer)."""
    def one(m: re.Match[str]) -> str:
        if only is not None and m.group("name") != only:
            return m.group(0)
        return m.group(1) + render(m.group("name"), doc_dir / m.group("source")) + "\n" + m.group(5)

    return BLOCK.sub(one, text)


def wrap(name: str, source: str, body: str) -> str:
    """A generated part with its markers, for a bench that writes a whole page (bench.scale)."""
    return f"<!-- bench:report {name} {source} -->\n{body.rstrip(chr(10))}\n<!-- /bench:report -->\n"
