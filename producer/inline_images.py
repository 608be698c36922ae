"""Inline images: a ``data:`` URI (an OpenAI Batch line's ``image_url``) becomes a ref.

The bytes are written once to the result store under ``keys.inline_input(job, sha256)`` (content
addressed within the job: the same image in many lines, or in the file submitted again, is one
object) and submitted as ``store:inputs/{job}/{sha256}``; workers read it from the store like any
other ref, under ``limits.max_bytes``, and only for a chunk of that job (``ocrq.net.fetch``): a line
of another job (another tenant's) that names the ref is refused, whatever it knows of the hash.
The size cap is applied to the URI's text before anything is decoded: an oversized URI costs no
decode and no memory beyond its line.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from urllib.parse import unquote_to_bytes

from ocrq import keys
from ocrq.errors import TooLarge
from ocrq.refs import STORE_SCHEME
from ocrq.store.storage import ResultStore
from producer.openai_requests import InvalidLine

_WHITESPACE = re.compile(rb"\s+")


def is_data_uri(url: str) -> bool:
    return url[:5].lower() == "data:"


def decode_data_uri(uri: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:[<media type>][;base64],<data>`` URI: ``TooLarge`` when its text
    alone says it is over ``max_bytes`` (before decoding) or its bytes are; ``InvalidLine`` when
    it is malformed."""
    header, comma, payload = uri[5:].partition(",")
    if not comma:
        raise InvalidLine("malformed data: URI (no ',' before the data)")
    b64 = header.lower().endswith(";base64")
    # base64: 4 characters per 3 bytes; percent-encoded: at most 3 characters per byte, at least 1
    limit = 4 * -(-max_bytes // 3) if b64 else 3 * max_bytes
    if len(payload) > limit + 64:  # (a little slack for line breaks inside the base64)
        raise TooLarge(f"data: URI of {len(payload):,} characters: more than limits.max_bytes ({max_bytes:,} bytes)")
    try:
        if b64:
            data = base64.b64decode(_WHITESPACE.sub(b"", payload.encode("ascii")), validate=True)
        else:
            data = unquote_to_bytes(payload)
    except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
        raise InvalidLine(f"malformed data: URI: {exc}") from exc
    if len(data) > max_bytes:
        raise TooLarge(f"data: URI of {len(data):,} bytes: more than limits.max_bytes ({max_bytes:,})")
    if not data:
        raise InvalidLine("empty data: URI")
    return data


#: inline images written together (one ``put_many``: concurrent PUTs on S3), and the bytes that
#: make a group written early
_GROUP = 64
_GROUP_BYTES = 32 * 1024 * 1024


class InlineImages:
    """Writes job ``job``'s inline images to ``store`` (each distinct one once per instance, in
    groups) and names them. ``flush`` before the refs are published: a ref names an object written."""

    def __init__(self, store: ResultStore, max_bytes: int, job: str) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self.job = job
        self._written: set[str] = set()
        self._pending: list[tuple[str, bytes]] = []
        self._pending_bytes = 0

    def ref(self, uri: str) -> str:
        """The ``store:`` ref of a ``data:`` URI's bytes (written to the store if not yet)."""
        data = decode_data_uri(uri, self.max_bytes)
        digest = hashlib.sha256(data).hexdigest()
        key = keys.inline_input(self.job, digest)
        if digest not in self._written:
            self._written.add(digest)
            self._pending.append((key, data))  # the same bytes under the same name: idempotent
            self._pending_bytes += len(data)
            if len(self._pending) >= _GROUP or self._pending_bytes >= _GROUP_BYTES:
                self.flush()
        return f"{STORE_SCHEME}:{key}"

    def flush(self) -> None:
        if self._pending:
            self.store.put_many(self._pending)
            self._pending, self._pending_bytes = [], 0
