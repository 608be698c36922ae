"""The layers docs/ARCHITECTURE.md draws, enforced by reading every import (ast: also imports
inside functions and under ``TYPE_CHECKING``), so the picture stays true.

    ocrq_cli                      the command line, above everything (``ocrq serve`` runs the API)
    api                           the HTTP front door, beside the command line, over the producer
    producer        worker        the two sides (worker: tasks → engine loop → governor, engines)
    ocrq/output, metrics, jobs, broker, store, net    what both sides share, each over those after it
    ocrq                          the contract (its top-level modules), imports none of the above

No import circles anywhere, bench/ and examples/ included: neither between modules nor between
folders (a folder is a package; worker/loop/ imports worker/governor/, never the other way).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the engine loop and the governor (every module of their folders): engines know none of them
LOOP = ("worker.loop",)
GOVERNOR = ("worker.governor",)
LOOP_AND_GOVERNOR = LOOP + GOVERNOR

#: inside ocrq/: the folders each one may import. The contract (ocrq's top-level modules) imports
#: none of ocrq's packages; each package imports the contract and the packages below it
INSIDE_OCRQ: dict[str, set[str]] = {
    "ocrq": set(),
    "ocrq.net": {"ocrq"},
    "ocrq.store": {"ocrq"},
    "ocrq.broker": {"ocrq"},
    "ocrq.jobs": {"ocrq", "ocrq.broker", "ocrq.store"},
    "ocrq.metrics": {"ocrq", "ocrq.broker", "ocrq.jobs"},
    "ocrq.output": {"ocrq", "ocrq.broker", "ocrq.jobs", "ocrq.store"},
}


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


def resolved_imports(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` imports, each once and exactly: ``from a import b``
    is ``a.b`` when that is a module, else ``a`` (a name defined in ``a``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = min(imports_of(ast.unparse(node), module, is_package), key=len)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found & known


def import_graph(*packages: str) -> dict[str, set[str]]:
    """module → the modules it imports, over every module of ``packages``."""
    paths = [path for package in packages for path in sorted((ROOT / package).rglob("*.py"))]
    known = {module_name(path) for path in paths}
    return {
        module_name(path): resolved_imports(path.read_text(), module_name(path), path.name == "__init__.py", known)
        - {module_name(path)}
        for path in paths
    }


def folder_of(module: str) -> str:
    """The folder a module's file is in, as a package name (a package's ``__init__`` is in its own)."""
    return module if (ROOT / module.replace(".", "/") / "__init__.py").exists() else module.rpartition(".")[0]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, imports in graph.items():
        out.setdefault(folder_of(module), set()).update(folder_of(i) for i in imports)
    return {folder: targets - {folder} for folder, targets in out.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: each strongly connected component of more than one node
    (Tarjan), its members sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


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
        # the shared contract imports neither side nor what sits above them
        (("ocrq",), ("producer", "worker", "ocrq_cli", "api")),
        # the sides never import the command line nor the API
        (("producer", "worker"), ("ocrq_cli", "api")),
        # the API is a layer over the producer: it never reaches into a worker, nor the CLI
        (("api",), ("worker", "ocrq_cli")),
        # engines know neither the loop nor the governor
        (("worker/engines",), LOOP_AND_GOVERNOR),
    ],
)
def test_layers(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    assert offenders(modules(*packages), forbidden) == []


def test_inside_ocrq_each_package_imports_only_those_below_it() -> None:
    folders = folder_graph(import_graph("ocrq"))
    assert set(folders) == set(INSIDE_OCRQ)
    assert {f: sorted(t - INSIDE_OCRQ[f]) for f, t in folders.items() if t - INSIDE_OCRQ[f]} == {}


def test_the_engines_loop_and_governor_import_only_the_contract() -> None:
    """What the GPU side of the worker needs from ocrq/ is the contract (errors, results,
    settings, prompts): none of ocrq's packages."""
    packages = tuple(f for f in INSIDE_OCRQ if f != "ocrq")
    assert offenders(modules("worker/engines", "worker/loop", "worker/governor"), packages) == []


def test_the_governor_is_pure_logic() -> None:
    """The governor sees numbers (token costs, bytes): no engine, no loop, no device library."""
    governor = modules("worker/governor")
    assert {"worker.governor.governor", "worker.governor.count_limit", "worker.governor.paged_kv",
            "worker.governor.packing", "worker.governor.calibration"} <= {name for name, _ in governor}
    assert offenders(governor, ("worker.engines", "worker.loop", "torch", "vllm", "pynvml")) == []


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # a function-level import counts, and ``from pkg import module`` is an edge to the module
    known = {"worker.x", "worker.x.a", "worker.x.b"}
    assert resolved_imports("def f():\n    from worker.x import b\n", "worker.x.a", False, known) == {"worker.x.b"}
    assert resolved_imports("from . import b, helper\n", "worker.x.a", False, known) == {"worker.x.b", "worker.x"}
    assert folder_graph({"worker.x.a": {"worker.y.b"}, "worker.y.b": {"worker.x.c"}}) == {
        "worker.x": {"worker.y"}, "worker.y": {"worker.x"}}


ALL = ("ocrq", "ocrq_cli", "worker", "producer", "api")
#: the product, and what runs it: benchmarks and examples have no import circle either
EVERYTHING = (*ALL, "bench", "examples")


def test_no_import_circle_between_modules() -> None:
    graph = import_graph(*EVERYTHING)
    assert {"worker.tasks", "ocrq.store.storage", "ocrq_cli.main", "producer.client", "bench.report",
            "bench.scale", "bench.chaos.verify"} <= set(graph)
    assert cycles(graph) == []


def test_no_import_circle_between_folders() -> None:
    folders = folder_graph(import_graph(*EVERYTHING))
    assert {"worker", "worker.loop", "worker.governor", "worker.engines.vllm", "ocrq", "bench",
            "bench.chaos"} <= set(folders)
    assert cycles(folders) == []


def test_every_message_is_published_through_one_module() -> None:
    """``send_task`` and Celery's ``retry`` are called in ocrq/broker/publish.py alone (the feed,
    the client, reprocess, the tasks and the export sweep go through it)."""
    calls = []
    for package in ALL:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "ocrq" / "broker" / "publish.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("send_task", "retry", "apply_async", "delay")):
                    calls.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.attr}")
    assert calls == []
