"""The layers docs/ARCHITECTURE.md draws, enforced by reading every import (ast: also imports
inside functions and under ``TYPE_CHECKING``), so the picture stays true.

    ocrq_cli                      the command line, above both sides
    producer        worker        the two sides (worker: tasks → engine loop → governor, engines)
    ocrq                          the shared contract, imports neither side
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the engine loop and the governor (with the modules it is made of): engines know none of them
LOOP = ("worker.loop.engine_loop", "worker.loop.intake", "worker.loop.oom", "worker.loop.engine_time")
GOVERNOR = (
    "worker.governor.governor",
    "worker.governor.count_limit",
    "worker.governor.paged_kv",
    "worker.governor.packing",
    "worker.governor.calibration",
)
LOOP_AND_GOVERNOR = LOOP + GOVERNOR


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` imports, fully qualified: ``from a import b`` yields ``a`` and
    ``a.b`` (b may be a submodule); relative imports are resolved against ``module``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return found


def modules(*packages: str) -> list[tuple[str, set[str]]]:
    out = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = module_name(path)
            out.append((name, imports_of(path.read_text(), name, path.name == "__init__.py")))
    return out


def offenders(mods: list[tuple[str, set[str]]], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{name} imports {imp}"
        for name, imps in mods
        for imp in imps
        if any(imp == f or imp.startswith(f + ".") for f in forbidden)
    )


def test_the_import_reader_sees_every_form() -> None:
    src = (
        "import producer.client\n"
        "from worker.loop import engine_loop\n"
        "def f():\n    from worker.governor.governor import Governor\n"
        "if TYPE_CHECKING:\n    from ..engines.base import Engine\n"
    )
    found = imports_of(src, "worker.x.y")
    assert {"producer.client", "worker.loop.engine_loop", "worker.governor.governor", "worker.engines.base"} <= found
    assert offenders([("m", found)], ("worker.loop.engine_loop",)) == ["m imports worker.loop.engine_loop"]
    assert offenders([("m", {"worker.engine_loopish"})], ("worker.loop.engine_loop",)) == []


def test_the_scan_reads_the_real_tree() -> None:
    names = {name for name, _ in modules("ocrq", "worker")}
    assert {"ocrq.errors", "worker.governor.governor", "worker.governor.packing", "worker.engines.vllm.engine"} <= names


@pytest.mark.parametrize(
    ("packages", "forbidden"),
    [
        # the shared contract imports neither side nor the command line above them
        (("ocrq",), ("producer", "worker", "ocrq_cli")),
        # the sides never import the command line
        (("producer", "worker"), ("ocrq_cli",)),
        # engines know neither the loop nor the governor
        (("worker/engines",), LOOP_AND_GOVERNOR),
    ],
)
def test_layers(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    assert offenders(modules(*packages), forbidden) == []


def test_the_governor_knows_no_engine() -> None:
    governor = [m for m in modules("worker") if m[0] in GOVERNOR]
    assert len(governor) == 5
    assert offenders(governor, ("worker.engines",)) == []
