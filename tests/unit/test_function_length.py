"""No product function runs over 60 lines (docs/ARCHITECTURE.md: modules under ~400 lines,
functions under ~60), measured with ast from ``def`` to its last line, docstring and nested
functions included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("ocrq", "ocrq_cli", "worker", "producer", "api")
MAX_LINES = 60

#: functions allowed over the limit, each with why (file:function -> reason)
ALLOWED = {
    # the transformers engine's batched greedy loop (prefill, the decode steps as one CUDA graph or
    # HF forwards, stop conditions) is being reworked with the engines' capability protocols; it
    # is split there, not moved twice
    "worker/engines/transformers/engine.py:_generate": "reworked with the engine capability protocols",
}


def long_functions() -> dict[str, int]:
    found = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_LINES:
                        found[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    return found


def test_no_function_is_over_60_lines() -> None:
    assert {name: n for name, n in long_functions().items() if name not in ALLOWED} == {}


def test_the_allowed_ones_are_still_long() -> None:
    """An entry whose function was split (or removed) leaves the list."""
    assert sorted(set(ALLOWED) - set(long_functions())) == []


def test_the_measure_sees_a_long_function() -> None:
    source = "def f():\n" + "    x = 1\n" * MAX_LINES
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef) and (node.end_lineno or 0) - node.lineno + 1 == MAX_LINES + 1
