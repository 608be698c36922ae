"""Image references: parsing, confinement to allowed roots, and expansion (``expand``) for producers
(workers read the bytes with ``ocrq.fetch``).

A reference is a local path (absolute, relative, or ``file://``), ``s3://bucket/key``, or an
``http(s)://`` URL. Containers expand to single-image refs:

* a local directory: its image files (by extension, case-insensitive), depth first in name order;
  hidden entries (``.name``) are skipped and a symlinked directory is entered once.
* ``s3://bucket/prefix/`` (trailing slash, or the bare bucket): the image keys under it (paginated).
* a manifest (``.jsonl`` or ``.csv``, local or on S3), streamed line by line. JSONL: one JSON
  object per line with a ``ref``/``path``/``url``/``uri`` field, or a bare JSON string. CSV: the
  first of those columns when the first row names one (a header), else the first column of every
  row. Relative entries resolve against the manifest's own directory (or S3 "directory"); entries
  may themselves be directories, prefixes or manifests (nesting is capped).

Canonical refs are absolute resolved local paths (no ``file://``), ``s3://bucket/key`` and URLs.

Policy for bad input, so that nothing is silently lost: a reference that is malformed, refused
(scheme, outside the allowed roots) or a manifest line without a usable ref is yielded as
``invalid:<reason>: <raw>``; ``fetch`` refuses that with ``RefusedRef`` and the worker records it
on the image. The raw text is never yielded as-is: a relative path from a manifest would resolve
against another directory on the worker. A container that cannot be read at all (missing
manifest or bucket, S3 down) raises its typed error instead, since its contents are unknown.

Confinement is enforced again by ``fetch`` (the worker is the boundary: anyone who can write to
the broker can submit any string).
"""

from __future__ import annotations

import csv
import functools
import io
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from botocore.exceptions import BotoCoreError, ClientError

from ocrq.errors import MissingObject, RefusedRef, StorageUnavailable
from ocrq.redact import redact_text
from ocrq.s3errors import s3_error
from ocrq.settings import LimitSettings

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp", ".gif", ".webp"})
MANIFEST_EXTENSIONS = frozenset({".jsonl", ".csv"})
REF_FIELDS = ("ref", "path", "url", "uri")
BAD_REF_PREFIX = "invalid:"
#: longer references are refused (RefusedRef): keeps every chunk message within its size cap
MAX_REF_CHARS = 8192
#: a manifest may list manifests this deep (also stops a manifest that lists itself)
MAX_MANIFEST_DEPTH = 3
_CHUNK = 1 << 16
# Two or more characters so a Windows drive letter is not a scheme; a relative local name with a
# colon needs "./" (as in RFC 3986).
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")


@dataclass(frozen=True)
class Ref:
    """One parsed, confined reference (``value`` is its canonical string)."""

    kind: Literal["local", "s3", "http"]
    value: str
    path: Path | None = None
    bucket: str = ""
    key: str = ""

    @property
    def is_prefix(self) -> bool:
        return self.kind == "s3" and (not self.key or self.key.endswith("/"))

    @property
    def is_manifest(self) -> bool:
        name = self.path.name if self.path is not None else self.key
        return self.kind != "http" and not self.is_prefix and _suffix(name) in MANIFEST_EXTENSIONS


def _suffix(name: str) -> str:
    dot = name.rfind(".")
    return name[dot:].lower() if dot > 0 and "/" not in name[dot:] else ""


def parse(ref: str, limits: LimitSettings, base: Path | str | None = None) -> Ref:
    """Parse and confine one reference, or raise ``RefusedRef``.

    ``base`` is where a relative entry resolves: a local directory, or ``s3://bucket/dir/`` for
    entries of a manifest stored on S3 (default: the current directory).
    """
    text = ref  # callers strip user input; file names may legitimately end in spaces
    if len(text) > MAX_REF_CHARS:
        raise RefusedRef(f"reference of {len(text)} characters (more than {MAX_REF_CHARS}):"
                         f" {redact_text(text[:100])}...")
    if not text.strip() or "\x00" in text or "\n" in text:
        raise RefusedRef(f"malformed reference: {ref!r}")
    match = _SCHEME.match(text)
    if match is None:
        if isinstance(base, str) and not text.startswith("/"):
            bucket, _, prefix = base[len("s3://"):].partition("/")
            return parse(f"s3://{bucket}/{prefix}{text}", limits)
        return _local(Path(text), text, limits, base)
    scheme = match.group(1).lower()
    if text.startswith(BAD_REF_PREFIX):
        raise RefusedRef(text[len(BAD_REF_PREFIX):])
    if scheme not in {s.lower() for s in limits.allowed_schemes}:
        raise RefusedRef(f"scheme {scheme!r} is not allowed: {text}")
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise RefusedRef(f"malformed file reference: {text}")
        return _local(Path(unquote(parts.path)), text, limits, base)
    if scheme == "s3":
        return _s3(text, limits)
    if scheme in ("http", "https"):
        try:
            parts = urlsplit(text)
            parts.port  # noqa: B018 - raises ValueError on a malformed port
        except ValueError as exc:
            raise RefusedRef(f"malformed URL: {text}") from exc
        if not parts.hostname:
            raise RefusedRef(f"malformed URL: {text}")
        return Ref("http", text)
    raise RefusedRef(f"scheme {scheme!r} is not supported: {text}")


def _s3(text: str, limits: LimitSettings) -> Ref:
    if text[2:5] != "://":
        raise RefusedRef(f"malformed s3 reference: {text}")
    # Keys are literal (no percent-decoding; '?' and '#' are part of the key).
    bucket, _, key = text[5:].partition("/")
    if not bucket or any(c.isspace() for c in bucket):
        raise RefusedRef(f"malformed s3 reference: {text}")
    if limits.s3_buckets and bucket not in limits.s3_buckets:
        raise RefusedRef(f"bucket {bucket!r} is not in limits.s3_buckets: {text}")
    return Ref("s3", f"s3://{bucket}/{key}", bucket=bucket, key=key)


@functools.lru_cache(maxsize=64)
def _resolved_roots(roots: tuple[Path, ...], cwd: Path) -> tuple[Path, ...]:
    # resolved once per (roots, cwd), not once per reference: submit streams millions of refs
    return tuple(r.resolve() for r in (roots or (cwd,)))


def _local(path: Path, raw: str, limits: LimitSettings, base: Path | str | None) -> Ref:
    cwd = Path.cwd()
    if not path.is_absolute():
        path = (base if isinstance(base, Path) else cwd) / path
    try:
        resolved = path.resolve()  # follows symlinks and '..' before the roots are checked
        roots = _resolved_roots(tuple(limits.allowed_roots), cwd)
    except (OSError, RuntimeError) as exc:  # symlink loops
        raise RefusedRef(f"unresolvable path: {raw}") from exc
    if not any(resolved.is_relative_to(root) for root in roots):
        raise RefusedRef(f"outside allowed roots: {raw}")
    return Ref("local", str(resolved), path=resolved)


def canonical(ref: str, limits: LimitSettings) -> str:
    """The canonical form of one reference (``RefusedRef`` if refused): for fail-fast checks."""
    return parse(ref, limits).value


# --- expansion ---------------------------------------------------------------------------------

def expand(inputs: Iterable[str], limits: LimitSettings, s3_client: Any | None = None) -> Iterator[str]:
    """Lazily expand references, directories, S3 prefixes and manifests into single-image refs."""
    for raw in inputs:
        if raw.strip():
            yield from _expand(raw.strip(), limits, s3_client, None, 0)


def _bad(reason: str) -> str:
    return f"{BAD_REF_PREFIX}{redact_text(reason)}"


def _expand(raw: str, limits: LimitSettings, s3: Any | None, base: Path | str | None,
            depth: int) -> Iterator[str]:
    try:
        ref = parse(raw, limits, base)
    except RefusedRef as exc:
        yield _bad(str(exc))
        return
    lines: Iterator[str]
    if ref.kind == "local" and ref.path is not None:
        if ref.path.is_dir():
            yield from _walk(ref.path, limits)
            return
        if not ref.is_manifest:
            yield ref.value
            return
        here: Path | str = ref.path.parent
        lines = _local_lines(ref.path)
    elif ref.kind == "s3" and (ref.is_prefix or ref.is_manifest):
        if s3 is None:
            raise RefusedRef(f"no S3 client to expand {ref.value}")
        if ref.is_prefix:
            yield from _list_s3(s3, ref.bucket, ref.key)
            return
        directory = ref.key.rpartition("/")[0]
        here = f"s3://{ref.bucket}/{directory}/" if directory else f"s3://{ref.bucket}/"
        lines = _s3_lines(s3, ref)
    else:
        yield ref.value
        return
    if depth >= MAX_MANIFEST_DEPTH:
        yield _bad(f"manifests nested deeper than {MAX_MANIFEST_DEPTH}: {ref.value}")
        return
    entries = _csv_entries(lines) if _suffix(ref.value) == ".csv" else _jsonl_entries(lines)
    for line_no, entry in entries:
        if entry is None:
            yield _bad(f"no reference on line {line_no} of {ref.value}")
        else:
            yield from _expand(entry, limits, s3, here, depth + 1)


def _walk(top: Path, limits: LimitSettings) -> Iterator[str]:
    seen = {str(top)}
    stack: list[Iterator[os.DirEntry[str] | str]] = [_entries(top)]
    while stack:
        entry = next(stack[-1], None)
        if entry is None:
            stack.pop()
            continue
        if isinstance(entry, str):
            yield entry
            continue
        is_dir = entry.is_dir()
        if entry.name.startswith(".") or not (is_dir or _suffix(entry.name) in IMAGE_EXTENSIONS):
            continue
        try:
            ref = parse(entry.path, limits)
        except RefusedRef as exc:  # a symlink out of the roots: recorded, never read
            yield _bad(str(exc))
            continue
        if is_dir:
            if ref.value not in seen:  # symlink loops and aliases are entered once
                seen.add(ref.value)
                stack.append(_entries(Path(entry.path)))
        else:
            yield ref.value


def _entries(directory: Path) -> Iterator[os.DirEntry[str] | str]:
    # One directory's listing is held (to sort it), never the whole tree.
    try:
        with os.scandir(directory) as it:
            listing = sorted(it, key=lambda e: e.name)
    except OSError as exc:  # an unreadable subdirectory is recorded, the walk goes on
        yield _bad(f"unreadable directory: {directory}: {exc.strerror}")
        return
    yield from listing


def _local_lines(path: Path) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8-sig", errors="replace", newline="") as handle:
            yield from handle
    except FileNotFoundError as exc:
        raise MissingObject(f"manifest not found: {path}") from exc
    except PermissionError as exc:
        raise RefusedRef(f"manifest not readable: {path}") from exc
    except OSError as exc:
        raise StorageUnavailable(f"cannot read manifest {path}: {exc}") from exc


class _BodyReader(io.RawIOBase):
    """Lets ``io.TextIOWrapper`` stream a botocore body line by line."""

    def __init__(self, body: Any) -> None:
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _s3_lines(s3: Any, ref: Ref) -> Iterator[str]:
    try:
        body = s3.get_object(Bucket=ref.bucket, Key=ref.key)["Body"]
        raw = io.BufferedReader(_BodyReader(body), _CHUNK)
        with io.TextIOWrapper(raw, encoding="utf-8-sig", errors="replace", newline="") as text:
            yield from text
    except (ClientError, BotoCoreError, OSError) as exc:
        raise s3_error(exc, ref.value) from exc


def _list_s3(s3: Any, bucket: str, prefix: str) -> Iterator[str]:
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", ()):
                key = obj["Key"]
                if not key.endswith("/") and _suffix(key.rpartition("/")[2]) in IMAGE_EXTENSIONS:
                    yield f"s3://{bucket}/{key}"
    except (ClientError, BotoCoreError, OSError) as exc:
        raise s3_error(exc, f"s3://{bucket}/{prefix}") from exc


def _jsonl_entries(lines: Iterable[str]) -> Iterator[tuple[int, str | None]]:
    for line_no, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if isinstance(value, dict):
            value = next((value[f] for f in REF_FIELDS if isinstance(value.get(f), str)), None)
        yield line_no, value.strip() if isinstance(value, str) and value.strip() else None


def _csv_entries(lines: Iterable[str]) -> Iterator[tuple[int, str | None]]:
    reader = csv.reader(lines)
    column = 0
    first = True
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error:  # e.g. a field over csv.field_size_limit: that line only
            yield reader.line_num, None
            continue
        if first:
            first = False
            names = [cell.strip().lower() for cell in row]
            found = next((names.index(f) for f in REF_FIELDS if f in names), None)
            if found is not None:
                column = found
                continue
        if not any(cell.strip() for cell in row):
            continue
        value = row[column].strip() if column < len(row) else ""
        yield reader.line_num, value or None
