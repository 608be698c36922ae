"""docs/bench/gpu-vllm.{json,md,png} from the rows ``bench.gpu_vllm`` wrote (one JSON per row).

The JSON is the issue's shape: ``{"cap_gb", "vllm", "runs": [{name, img_per_s, failed,
preemptions, peak_gb, ...}]}``; the markdown table between docs/bench/gpu-vllm.md's
``bench:report gpu-vllm`` markers is rebuilt from it (bench/report.py, also ``python -m bench report``),
so the prose around it stays hand-written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.report_tables import rebuild

ORDER = ["vllm-seeds", "vllm-default", "ocrq-vllm", "ocrq-vllm-server", "ocrq-transformers", "vllm-default-8g",
         "ocrq-vllm-8g"]


def _rows(dirs: list[Path], transformers: Path | None) -> list[dict[str, Any]]:
    rows = {}
    for d in dirs:
        for path in sorted(d.glob("*.json")):
            row = json.loads(path.read_text())
            if "name" in row and "img_per_s" in row:
                rows[row["name"]] = row
    if transformers is not None and transformers.exists():
        data = json.loads(transformers.read_text())
        warm = [j for j in data["jobs"] if j.get("start") == "warm"] or data["jobs"][-1:]
        job = warm[0]
        rows["ocrq-transformers"] = {
            "name": "ocrq-transformers", "kind": "ocrq-transformers", "img_per_s": job["img_per_s"],
            "failed": job["failed"], "preemptions": None, "peak_gb": job.get("max_measured_peak_gb"),
            "first_img_per_s": data["jobs"][0]["img_per_s"],
        }
    return [rows[n] for n in ORDER if n in rows] + [r for n, r in rows.items() if n not in ORDER]


KEYS = ("name", "cap_gb", "max_num_batched_tokens", "img_per_s", "first_img_per_s", "third_img_per_s", "failed",
        "preemptions", "peak_gb", "peak_processes_gb", "small_first_result_s", "small_done_s", "build_s",
        "worker_ready_s", "server_ready_s", "max_num_seqs", "concurrent_batches")


def rows(dirs: list[Path], transformers: Path | None) -> list[dict[str, Any]]:
    """The rows of gpu-vllm.json's ``runs``, from row folders (and a bench.gpu_worker result)."""
    found = _rows(dirs, transformers)
    for r in found:
        r.setdefault("cap_gb", 24.0)
    return found


def report(dirs: list[Path], transformers: Path | None, out: Path, vllm_version: str = "0.26.0") -> dict[str, Any]:
    rows_ = rows(dirs, transformers)
    # "× best plain" compares rows under the same memory budget
    best: dict[float, float] = {}
    for r in rows_:
        if r.get("kind") == "plain-vllm":
            best[r["cap_gb"]] = max(best.get(r["cap_gb"], 0.0), r["img_per_s"])
    best_plain = best.get(24.0)
    runs = [{k: r.get(k) for k in KEYS} for r in rows_]
    doc = {"cap_gb": 24, "vllm": vllm_version, "runs": runs,
           "best_plain_img_per_s": best_plain,
           "ocrq_vllm_vs_best_plain": (round(next(r["img_per_s"] for r in rows_ if r["name"] == "ocrq-vllm")
                                             / best_plain, 3) if best_plain and any(r["name"] == "ocrq-vllm"
                                                                                    for r in rows_) else None)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-vllm.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = out / "gpu-vllm.md"
    if md.exists():
        md.write_text(rebuild(md.read_text(), out, only="gpu-vllm"))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.barh([r["name"] for r in runs][::-1], [r["img_per_s"] for r in runs][::-1], color="#4c72b0")
        ax.set_xlabel("images/s (200 mixed pages, 256 tokens; budget in the row name, else 24 GiB)")
        fig.tight_layout()
        fig.savefig(out / "gpu-vllm.png", dpi=120)
    except ImportError:  # the plot is optional; the table and JSON are the record
        pass
    return doc
