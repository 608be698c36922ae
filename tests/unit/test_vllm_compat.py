"""The vLLM family table (``worker.engines.vllm.compat``) and the rule that keeps version-dependent
vLLM imports in that one module. No vLLM needed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from worker.engines.vllm import compat
from worker.engines.vllm.compat import FIXES, VERIFIED, family_of

ROOT = Path(__file__).resolve().parents[2]

#: vLLM modules whose place or content differs between the supported releases: only compat
#: imports them (0.26's native model, the serve parser that moved, the client error type)
MOVED = ("vllm.model_executor.models.hunyuan_vision", "vllm.model_executor.models.transformers",
         "vllm.entrypoints.openai.cli_args", "vllm.entrypoints.launchers", "vllm.entrypoints.common",
         "vllm.entrypoints.serve.utils", "vllm.exceptions", "vllm.v1.engine.exceptions")


@pytest.mark.parametrize(("version", "cpu", "fixes"), [
    ("0.26.0", True, ("image_boundary", "xdrope_cpu", "vision_groups", "encoder_graphs")),
    ("0.26.0", False, ("image_boundary", "vision_groups", "encoder_graphs")),
    ("0.32.0", True, ("pil_processor", "contiguous_merger", "split_fix")),
    ("0.33.0", False, ("split_fix",)),
    ("0.33.0", True, ()),  # no CPU build of 0.33 to check: nothing applied, a warning
    ("0.34.0", False, ("split_fix",)),  # read from its wheel: 0.32's split code again
    ("0.34.0", True, ()),
    ("0.35.0", False, ()),  # not read yet: nothing applied, a warning
    ("0.27.1", False, ()),
])
def test_each_family_gets_its_fixes(version: str, cpu: bool, fixes: tuple[str, ...]) -> None:
    assert family_of(version, cpu).fixes() == fixes


def test_the_native_model_paths_are_for_0_26_only() -> None:
    assert family_of("0.26.0+cpu", True).native_model and family_of("0.26.0+cpu", True).release == "0.26"
    assert not family_of("0.32.0", True).native_model
    assert not family_of("0.33.0", False).native_model
    assert not family_of("0.34.0", False).native_model


def test_verified_families_are_in_the_table_and_0_33_and_0_34_are_not_verified() -> None:
    assert VERIFIED <= set(FIXES)
    assert family_of("0.33.0", False).known and not family_of("0.33.0", False).verified
    assert family_of("0.34.0", False).known and not family_of("0.34.0", False).verified
    assert family_of("0.32.0", True).verified


def test_every_fix_in_the_table_exists_in_the_plugin() -> None:
    from worker.engines.vllm import plugin

    named = {name for fixes in FIXES.values() for name in fixes} | set(compat.NATIVE_PATHS)
    assert named == set(plugin._FIXES)


def _vllm_modules(line: str) -> list[str]:
    """vLLM modules a line imports: ``import vllm.x``, ``from vllm.x import y`` (vllm.x and
    vllm.x.y), ``import_module("vllm.x")``."""
    found = re.findall(r"^\s*import\s+(vllm(?:\.\w+)+)", line) + re.findall(r"import_module\(\"(vllm[\w.]*)\"\)", line)
    if m := re.match(r"^\s*from\s+(vllm[\w.]*)\s+import\s+([\w, ]+)", line):
        found += [m.group(1)] + [f"{m.group(1)}.{name.split()[0]}" for name in m.group(2).split(",") if name.strip()]
    return found


def test_the_import_scan_sees_each_form() -> None:
    assert "vllm.model_executor.models.hunyuan_vision" in _vllm_modules(
        "    from vllm.model_executor.models import hunyuan_vision as hv")
    assert _vllm_modules("from vllm.exceptions import VLLMClientError")[0] == "vllm.exceptions"
    assert _vllm_modules('    x = importlib.import_module("vllm.entrypoints.launchers.cli_args")')


def test_version_dependent_vllm_imports_live_in_vllm_compat() -> None:
    """An import of a module in MOVED anywhere in the worker, tests or bench but compat.py."""
    offenders = []
    for path in [*ROOT.glob("worker/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/**/*.py")]:
        if path.name in ("compat.py", "test_vllm_compat.py"):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            offenders += [f"{path.relative_to(ROOT)}:{number}: {module}" for module in _vllm_modules(line)
                          if module.startswith(MOVED)]
    assert not offenders, offenders
