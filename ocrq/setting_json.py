"""Settings the environment gives as JSON text: a list or a mapping (``OCRQ_LIMITS__ALLOWED_ROOTS='["/data"]'``).

pydantic-settings decodes such a variable only for the fields of the class a section declares;
``engine``'s fields follow its kind (``ocrq.engine_settings``), so the engine's are decoded here
once the kind's class is known, and ``ocrq.settings_check`` names what a malformed one must be."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping
from typing import Any


def json_kind(annotation: Any) -> str | None:
    """"a list" / "a mapping" for a field the environment sets as JSON, else None."""
    origin = typing.get_origin(annotation) or annotation
    if origin in (typing.Union, types.UnionType):
        return next((c for a in typing.get_args(annotation) if (c := json_kind(a))), None)
    if origin in (list, set, tuple, frozenset):
        return "a list"
    if origin in (dict, Mapping):
        return "a mapping"
    return None


def decoded(value: Any, annotation: Any) -> Any:
    """``value`` decoded from JSON when it is text and the field takes a list or a mapping; as it
    is otherwise, or when it is not JSON (the field's own error then says what it must be)."""
    if not isinstance(value, str) or json_kind(annotation) is None:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
