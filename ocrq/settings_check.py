"""What is wrong with a process's settings, in one line per problem.

Unknown names are errors, never ignored: an ``OCRQ_*`` environment variable or a YAML key that
names no setting (at any depth) is refused with the nearest valid name (``OCRQ_LIMTS__MAX_BYTES``:
did you mean ``OCRQ_LIMITS__MAX_BYTES``?). A profile that does not exist is refused too. A value
a setting cannot take is one line naming the setting, the value, where it came from and what it
must be (``engine.kind = 'vlm' (OCRQ_ENGINE__KIND): expected 'rapidocr', 'transformers', …``).

Some ``OCRQ_*`` variables are not settings: ocrq or its tests read them by name. They are listed
here, each with what reads it (``NOT_SETTINGS``); a new one goes into this list, or it is refused
as an unknown setting (tests/unit/test_settings_check.py finds every ``OCRQ_`` name in the tree
and checks it is one or the other).
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from ocrq.engine_registry import all_engine_fields
from ocrq.engine_settings import EngineSettings
from ocrq.setting_json import json_kind

PREFIX = "OCRQ_"
NESTED = "__"

#: ``OCRQ_*`` environment variables that are not settings, and what reads each
NOT_SETTINGS: dict[str, str] = {
    "OCRQ_CONFIG": "the YAML profile to load (`ocrq --config`)",
    "OCRQ_COMMIT": "the commit a benchmark manifest names in a copy without .git (bench/manifest.py)",
    "OCRQ_VLLM_DISABLE_FIXES": "vLLM fixes to leave out, in every vLLM process (worker/engines/vllm/plugin.py)",
    "OCRQ_VLLM_VISION_GROUP_PATCHES": "set by the worker for its vLLM processes (worker/engines/vllm/vision.py)",
    "OCRQ_VLLM_START_LOG": "a file for vLLM's start phases (worker/engines/vllm/startup.py)",
    "OCRQ_FULL_CHECKPOINT": "where the GPU tests keep their full-size checkpoint (tests/gpu)",
    "OCRQ_TEST_WORKER_NAME": "the name the integration tests give a worker process (tests/integration)",
    "OCRQ_TEST_BATCH_LINES": "lines of the OpenAI Batch test file (tests/integration/test_openai_batch.py)",
}


class SettingsError(ValueError):
    """Settings ocrq cannot take: each line names the setting, where it came from and what
    would be valid."""


# --- the names a model takes -----------------------------------------------------------------

def _section(annotation: Any) -> type[BaseModel] | None:
    """The model class a field holds (``Model`` or ``Model | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _section(arg)
            if found is not None:
                return found
    return None


def _open(annotation: Any) -> bool:
    """Whether a field takes any keys below it (a ``dict``: ``engine.extra``)."""
    origin = typing.get_origin(annotation) or annotation
    if origin in (typing.Union, types.UnionType):
        return any(_open(a) for a in typing.get_args(annotation))
    return origin is dict or origin is Mapping


def model_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """A section's fields; ``engine``'s are every engine kind's (its class follows ``engine.kind``)."""
    return all_engine_fields() if issubclass(model, EngineSettings) else dict(model.model_fields)


def setting_paths(model: type[BaseModel], base: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str]]:
    """Every setting's path with its kind: "section", "leaf" or "open" (takes any key below)."""
    for name, field in model_fields(model).items():
        path = (*base, name)
        sub = _section(field.annotation)
        if sub is not None:
            yield path, "section"
            yield from setting_paths(sub, path)
        else:
            yield path, "open" if _open(field.annotation) else "leaf"


def env_name(path: Sequence[str | int]) -> str:
    return PREFIX + NESTED.join(str(p) for p in path).upper()


def dotted(path: Sequence[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def nearest(name: str, candidates: Sequence[str]) -> str | None:
    found = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return found[0] if found else None


def _did_you_mean(best: str | None) -> str:
    return f": did you mean {best}?" if best else ""


# --- checks ----------------------------------------------------------------------------------

def unknown_variables(environ: Mapping[str, str], model: type[BaseModel]) -> list[str]:
    """One line per ``OCRQ_*`` variable that is neither a setting nor in ``NOT_SETTINGS``."""
    known: set[str] = set()
    open_prefixes: list[str] = []
    for path, kind in setting_paths(model):
        known.add(env_name(path))
        if kind == "open":
            open_prefixes.append(env_name(path) + NESTED)
    candidates = sorted(known | set(NOT_SETTINGS))
    lines = []
    for raw in sorted(environ):
        name = raw.upper()
        if not name.startswith(PREFIX) or name in known or name in NOT_SETTINGS:
            continue
        if any(name.startswith(p) for p in open_prefixes):
            continue
        lines.append(f"unknown setting {raw} (environment){_did_you_mean(nearest(name, candidates))}"
                     " — every setting: ocrq/settings.py, ocrq/engine_settings.py")
    return lines


def unparsable_variables(environ: Mapping[str, str], model: type[BaseModel]) -> list[str]:
    """One line per variable of a list or mapping setting whose value is not JSON."""
    env = {k.upper(): k for k in environ}
    lines = []
    for path, field in _fields(model):
        name = env_name(path)
        kind = json_kind(field.annotation)
        if kind is None or name not in env:
            continue
        value = environ[env[name]]
        try:
            json.loads(value)
        except ValueError:
            example = """'["/data"]'""" if kind == "a list" else """'{"key": "value"}'"""
            lines.append(f"setting {dotted(path)} = {_shown(value)} ({env[name]}): {kind} is set from the "
                         f"environment as JSON, e.g. {env[name]}={example}")
    return lines


def _fields(model: type[BaseModel], base: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name, field in model_fields(model).items():
        sub = _section(field.annotation)
        if sub is not None:
            yield from _fields(sub, (*base, name))
        else:
            yield (*base, name), field


def check_environment(environ: Mapping[str, str], model: type[BaseModel]) -> None:
    lines = unknown_variables(environ, model) + unparsable_variables(environ, model)
    if lines:
        raise SettingsError("\n".join(lines))


def check_profile(profile: str | Path, source: str) -> None:
    """A profile that is not a readable file is refused (``source``: where its name came from)."""
    path = Path(profile)
    if not path.is_file():
        raise SettingsError(f"settings profile {profile} ({source}) does not exist"
                            + ("" if path.is_absolute() else f" in {Path.cwd()}")
                            + ": give a path to a YAML file (configs/*.yaml in the repository)")


def _yaml_has(profile_data: Mapping[str, Any] | None, path: Sequence[str | int]) -> bool:
    node: Any = profile_data
    for part in path:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return False
    return True


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def explain(exc: ValidationError, model: type[BaseModel], environ: Mapping[str, str],
            profile: str | None = None, profile_data: Mapping[str, Any] | None = None) -> SettingsError:
    """``exc`` as one line per error: the setting, its value, its source and what it must be."""
    env = {k.upper(): k for k in environ}
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        where = _source(loc, env, profile, profile_data)
        if err["type"] == "extra_forbidden":
            lines.append(_unknown_key(loc, model, where))
            continue
        expected = err.get("ctx", {}).get("expected")
        what = f"expected {expected}" if err["type"] == "literal_error" and expected else err["msg"]
        value = "" if err["type"] == "missing" else f" = {_shown(err.get('input'))}"
        lines.append(f"setting {dotted(loc)}{value} ({where}): {what}")
    return SettingsError("\n".join(lines) or str(exc))


def _source(loc: tuple[Any, ...], env: Mapping[str, str], profile: str | None,
            profile_data: Mapping[str, Any] | None) -> str:
    for depth in range(len(loc), 0, -1):  # OCRQ_LIMITS__ALLOWED_ROOTS for limits.allowed_roots[0]
        name = env_name(loc[:depth])
        if name in env:
            return env[name]
    if profile and _yaml_has(profile_data, loc):
        return f"in {profile}"
    return "given to Settings"


def _unknown_key(loc: tuple[Any, ...], model: type[BaseModel], where: str) -> str:
    parent = loc[:-1]
    section: type[BaseModel] | None = model
    for part in parent:
        field = model_fields(section).get(str(part)) if section is not None else None
        section = _section(field.annotation) if field is not None else None
    names = list(model_fields(section)) if section is not None else []
    best = nearest(str(loc[-1]), names)
    return (f"unknown setting {dotted(loc)} ({where})"
            + _did_you_mean(dotted((*parent, best)) if best else None))
