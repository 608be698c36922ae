"""The shipped configuration files stay in step with the settings model: every YAML profile
loads, and every OCRQ_* variable docker-compose.yml sets names a real settings field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from ocrq.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("profile", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_profiles_load(profile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OCRQ_CONFIG", str(profile))
    settings = Settings()
    raw = yaml.safe_load(profile.read_text())
    # every section and key in the file is a field the model knows (extra keys would be ignored)
    for section, values in raw.items():
        model = getattr(settings, section)
        if isinstance(values, dict):
            assert isinstance(model, BaseModel), section
            unknown = set(values) - set(type(model).model_fields)
            assert not unknown, f"{profile.name}: unknown {section} keys {unknown}"


def _field_exists(path: list[str]) -> bool:
    model: type[BaseModel] = Settings
    for i, part in enumerate(path):
        field = model.model_fields.get(part)
        if field is None:
            return False
        ann = field.annotation
        if i < len(path) - 1:
            if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
                return False
            model = ann
    return True


def test_compose_environment_names_real_settings() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    names: set[str] = set()
    for block in [compose.get("x-ocrq-env", {})] + [svc.get("environment", {}) for svc in compose["services"].values()]:
        names |= {k for k in block if k.startswith("OCRQ_") and k != "OCRQ_CONFIG"}
    assert names, "compose sets no OCRQ_ variables?"
    bad = [n for n in names if not _field_exists(n[len("OCRQ_"):].lower().split("__"))]
    assert not bad, bad
    for svc in compose["services"].values():
        config = (svc.get("environment") or {}).get("OCRQ_CONFIG")
        if config:
            assert (ROOT / config.removeprefix("/app/")).exists(), config
