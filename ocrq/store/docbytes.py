"""A stored document's bytes: the one JSON encoding every store writes (S3, SQLite, files)."""

from __future__ import annotations

import json
from typing import Any


def dumps_doc(doc: Any) -> bytes:
    """A document's bytes: JSON-able values are serialized; bytes are taken as JSON already."""
    if isinstance(doc, bytes | bytearray):
        return bytes(doc)
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
