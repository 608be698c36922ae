"""Settings that name no setting are refused, with the nearest valid name; a missing profile is
refused; a bad value is one line naming the setting, the value, its source and its choices. The
OCRQ_* variables that are not settings are listed, and the list covers every one in the tree."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from ocrq.settings import Settings, SettingsError, load_settings
from ocrq.settings_check import NOT_SETTINGS, env_name, setting_paths, unknown_variables

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.upper().startswith("OCRQ_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(("name", "nearest"), [
    ("OCRQ_LIMTS__MAX_BYTES", "OCRQ_LIMITS__MAX_BYTES"),
    ("OCRQ_CONFG", "OCRQ_CONFIG"),
    ("OCRQ_LIMITS__MAX_BYTEZ", "OCRQ_LIMITS__MAX_BYTES"),
    ("OCRQ_REDIS__URLL", "OCRQ_REDIS__URL"),
    ("OCRQ_FLOWER_PORTT", "OCRQ_FLOWER_PORT"),
])
def test_an_unknown_variable_is_an_error_naming_the_nearest_setting(monkeypatch: pytest.MonkeyPatch, name: str,
                                                                     nearest: str) -> None:
    monkeypatch.setenv(name, "1")
    with pytest.raises(SettingsError) as err:
        load_settings()
    text = str(err.value)
    assert len(text.splitlines()) == 1
    assert f"unknown setting {name} (environment): did you mean {nearest}?" in text
    # Settings() itself refuses it too: every process, not only the command line
    with pytest.raises(SettingsError):
        Settings()


def test_names_that_are_settings_or_listed_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NOT_SETTINGS:
        monkeypatch.setenv(name, "x" if name != "OCRQ_CONFIG" else "")
    monkeypatch.setenv("OCRQ_ENGINE__EXTRA__RAPIDOCR", "{}")  # a mapping takes any key below it
    monkeypatch.setenv("ocrq_queue__chunk_size", "8")  # as pydantic-settings reads it: any case
    assert Settings().queue.chunk_size == 8


def test_a_yaml_key_that_names_no_setting_is_an_error(tmp_path: Path) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text("limits:\n  allowed_rootz: [/data]\nlimts: {}\n")
    with pytest.raises(SettingsError) as err:
        load_settings(profile)
    lines = str(err.value).splitlines()
    assert f"unknown setting limits.allowed_rootz (in {profile}): did you mean limits.allowed_roots?" in lines
    assert f"unknown setting limts (in {profile}): did you mean limits?" in lines


def test_a_missing_profile_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SettingsError, match=r"settings profile configs/gpu-vllm.yaml .* does not exist in "):
        load_settings("configs/gpu-vllm.yaml")
    monkeypatch.setenv("OCRQ_CONFIG", "nonexist.yaml")
    with pytest.raises(SettingsError, match="nonexist.yaml"):
        load_settings()


def test_a_bad_value_is_one_line_with_the_setting_value_source_and_choices(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    monkeypatch.setenv("OCRQ_ENGINE__KIND", "vlm")
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert str(err.value) == ("setting engine.kind = 'vlm' (OCRQ_ENGINE__KIND): expected 'rapidocr', "
                              "'transformers', 'vllm', 'vllm-server' or 'simulated'")
    monkeypatch.delenv("OCRQ_ENGINE__KIND")
    profile = tmp_path / "p.yaml"
    profile.write_text("queue:\n  chunk_size: many\n")
    with pytest.raises(SettingsError) as err:
        load_settings(profile)
    assert str(err.value).startswith(f"setting queue.chunk_size = 'many' (in {profile}): "
                                     "Input should be a valid integer")


def test_a_list_from_the_environment_that_is_not_json_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OCRQ_LIMITS__ALLOWED_ROOTS", "/data")
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert str(err.value) == ("setting limits.allowed_roots = '/data' (OCRQ_LIMITS__ALLOWED_ROOTS): a list is set "
                              """from the environment as JSON, e.g. OCRQ_LIMITS__ALLOWED_ROOTS='["/data"]'""")


def test_the_walk_of_the_model_knows_sections_leaves_and_open_mappings() -> None:
    kinds = {env_name(path): kind for path, kind in setting_paths(Settings)}
    assert kinds["OCRQ_LIMITS"] == "section" and kinds["OCRQ_LIMITS__MAX_BYTES"] == "leaf"
    assert kinds["OCRQ_ENGINE__EXTRA"] == "open" and kinds["OCRQ_CPU_HOUR_USD"] == "leaf"
    assert unknown_variables({"OCRQ_ENGINE__EXTRA__ANYTHING__DEEP": "1", "PATH": "/bin"}, Settings) == []


#: files that spell wrong names on purpose: what the check refuses, and its tests
_MISTAKES_SHOWN = {"ocrq/settings_check.py", "tests/unit/test_settings_check.py", "README.md",
                   "tests/integration/test_cli_outcomes.py", "docs/CHANGELOG.md"}


def test_every_ocrq_name_in_the_tree_is_a_setting_or_listed() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found: dict[str, str] = {}
    for path in files:
        file = ROOT / path
        if not file.is_file() or file.suffix in (".png", ".jpg", ".gz", ".parquet", ".pdf") or path in _MISTAKES_SHOWN:
            continue
        for name in re.findall(r"\bOCRQ_[A-Z0-9_]*[A-Z0-9]", file.read_text(errors="replace")):
            found.setdefault(name, path)
    settings = {env_name(path) for path, _ in setting_paths(Settings)}
    open_prefixes = [env_name(path) + "__" for path, kind in setting_paths(Settings) if kind == "open"]
    stray = {name: path for name, path in found.items()
             if name not in settings and name not in NOT_SETTINGS
             and not any(name.startswith(p) for p in open_prefixes)}
    assert not stray, f"neither settings nor in ocrq.settings_check.NOT_SETTINGS: {stray}"
    assert len(found) > 40  # the search does find them
