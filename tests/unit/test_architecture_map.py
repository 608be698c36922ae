"""docs/ARCHITECTURE.md's module map matches the tree: every module it names exists, and every
module of ocrq, ocrq_cli, producer, worker and api is named in it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ocrq", "ocrq_cli", "producer", "worker", "api")


def named() -> set[str]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    pattern = r"\b((?:" + "|".join(PACKAGES) + r")/[\w/]+\.py)\b"
    return set(re.findall(pattern, text))


def test_every_module_named_exists() -> None:
    assert sorted(p for p in named() if not (ROOT / p).is_file()) == []


def test_every_module_is_named() -> None:
    tree = {str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
            if p.name not in ("__init__.py", "__main__.py")}
    assert sorted(tree - named()) == []
