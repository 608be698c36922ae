"""``python -m bench report [--check]``: the docs' generated tables, rebuilt from the JSON the runs wrote.

A generated part of a document sits between two markers; the rest of the document is prose and
stays as written::

    <!-- bench:report NAME SOURCE -->
    ...what RENDERERS[NAME] makes of SOURCE (a JSON file, relative to the document; for
    FOLDER_RENDERERS, a folder of a run's raw rows)...
    <!-- /bench:report -->

The markers and the JSON tables are bench/report_tables.py's; here: the renderers that need a
benchmark's own code (bench.scale's page, bench.gpu_vllm_report's rows), and the command.

``--check`` writes nothing and exits 1 when a document differs from what it would write (a
hand edit of a figure, or a JSON that moved without its table).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report_tables import BLOCK, gpu_vllm, render_table
from bench.report_tables import rebuild as rebuild_with

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "docs" / "bench", ROOT / "docs")


def gpu_vllm_rows(folder: Path) -> str:
    """An older run's table in docs/bench/gpu-vllm.md, from its raw rows (runs/<date>-<commit>/)."""
    from bench.gpu_vllm_report import KEYS, rows

    if not folder.is_dir():
        raise FileNotFoundError(folder)
    return gpu_vllm({"runs": [{k: r.get(k) for k in KEYS} for r in rows([folder], folder / "gpu_worker.json")]})


def _scale(doc: dict[str, Any], source: Path) -> str:
    from bench.scale import report

    return report(doc, (source.parent / "scale.png").exists()).rstrip("\n")


#: renderers of a folder of a run's raw rows (SOURCE ends with /)
FOLDER_RENDERERS: dict[str, Callable[[Path], str]] = {"gpu-vllm-rows": gpu_vllm_rows}


def render(name: str, source: Path) -> str:
    if name in FOLDER_RENDERERS:
        return FOLDER_RENDERERS[name](source)
    if name == "scale":  # the whole page is bench.scale's (it also writes it after a run)
        return _scale(json.loads(source.read_text()), source)
    return render_table(name, source)


def rebuild(text: str, doc_dir: Path, only: str | None = None) -> str:
    """text with its generated parts rebuilt (only: those of that renderer)."""
    return rebuild_with(text, doc_dir, only, render)


def documents() -> list[Path]:
    return sorted(p for d in DOCS for p in d.glob("*.md") if BLOCK.search(p.read_text()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a document would change")
    args = ap.parse_args(argv)
    stale = []
    for path in documents():
        text = path.read_text()
        new = rebuild(text, path.parent)
        blocks = len(BLOCK.findall(text))
        rel = path.relative_to(ROOT)
        if new == text:
            print(f"{rel}: {blocks} table(s) up to date")
            continue
        stale.append(rel)
        if not args.check:
            path.write_text(new)
        print(f"{rel}: {blocks} table(s) {'differ' if args.check else 'rewritten'}")
    if args.check and stale:
        print("run `python -m bench report` (or fix the JSON): " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    return 0
