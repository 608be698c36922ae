"""Expansion of what a producer is given into single-image refs (``expand_entries``):

* a local directory: every regular file in it, whatever its name (the worker sniffs the content:
  magic bytes, not the extension), depth first in name order. Skipped, counted and listed: hidden
  entries (``.name``, and everything under a hidden directory), manifests found inside a folder,
  and entries that are not regular files (FIFOs, sockets, broken symlinks). A symlinked
  directory is entered once.
* ``s3://bucket/prefix/`` (trailing slash, or the bare bucket): every object under it (paginated),
  with the same rule for hidden path components and manifests; "folder" marker keys ending in
  ``/`` are not objects.
  Files found by either walk are marked ``found``: ``--match`` may skip them at intake
  (``producer.name_filter``); a file named on its own is not filtered.
* a manifest (``.jsonl`` or ``.csv``, local or on S3), streamed line by line (formats:
  ``producer.manifests``). A row's other fields (``id``, ``metadata``, any column) travel with its
  ref into the result, unchanged. Relative entries resolve against the manifest's own directory
  (or S3 "directory"); entries may themselves be directories, prefixes or manifests (nesting is
  capped).

Each reference is parsed and confined by ``ocrq.refs``. Nothing is silently lost: every file
found is an ``Entry`` — a ref, skipped (with the rule that skipped it), or refused (malformed,
scheme, outside the allowed roots, bucket not allowed, unreadable directory, a manifest line
without a usable ref). Producers refuse a submission with any refused entry before publishing
anything (``producer.intake``). A container that cannot be read at all (missing manifest or bucket,
S3 down) raises its typed error instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from botocore.exceptions import BotoCoreError, ClientError

from ocrq.errors import RefusedRef
from ocrq.messages import MAX_ROW_BYTES
from ocrq.redact import redact_text, shown_ref
from ocrq.refs import BAD_REF_PREFIX, MANIFEST_EXTENSIONS, parse, suffix
from ocrq.s3errors import s3_error
from ocrq.settings import LimitSettings
from producer.lines import LongLine
from producer.manifests import MAX_LINE_BYTES, local_lines, manifest_rows, s3_lines

#: a manifest may list manifests this deep (also stops a manifest that lists itself)
MAX_MANIFEST_DEPTH = 3


@dataclass(frozen=True)
class Entry:
    """One outcome of expanding the inputs: a single-image ``ref`` to submit, a file ``skipped``
    by the documented rule (hidden, a manifest inside a folder, not a regular file), or a
    reference ``refused`` (malformed, scheme, roots, bucket, unreadable directory, bad manifest
    line). ``value`` is the canonical ref, or the raw text when skipped/refused."""

    kind: Literal["ref", "skipped", "refused"]
    value: str
    reason: str = ""
    #: a manifest row's other columns, carried into the result unchanged
    row: dict[str, Any] | None = None
    #: a ref as it was named when that differs from ``value`` (a symlink, a relative path)
    source: str = ""
    #: found by listing a folder or an S3 prefix, not named (``--match`` filters only these)
    found: bool = False


def expand_entries(inputs: Iterable[str], limits: LimitSettings,
                   s3_client: Any | None = None) -> Iterator[Entry]:
    """Lazily expand references, directories, S3 prefixes and manifests; every file found is an
    ``Entry`` (never silently dropped)."""
    dirs: dict[str, str] = {}
    for raw in inputs:
        if raw.strip():
            yield from _expand(raw.strip(), limits, s3_client, None, 0, None, dirs)


def expand(inputs: Iterable[str], limits: LimitSettings, s3_client: Any | None = None) -> Iterator[str]:
    """Single-image refs only (refused ones as ``invalid:<reason>``; skipped files left out)."""
    for entry in expand_entries(inputs, limits, s3_client):
        if entry.kind == "ref":
            yield entry.value
        elif entry.kind == "refused":
            yield _bad(entry.reason)


def _bad(reason: str) -> str:
    return f"{BAD_REF_PREFIX}{redact_text(reason)}"


def _refused(raw: str, reason: str) -> Entry:
    return Entry("refused", raw, reason)


def _expand(raw: str, limits: LimitSettings, s3: Any | None, base: Path | str | None,
            depth: int, row: dict[str, Any] | None, dirs: dict[str, str]) -> Iterator[Entry]:
    try:
        ref = parse(raw, limits, base, dirs=dirs)
    except RefusedRef as exc:
        yield _refused(raw, str(exc))
        return
    lines: Iterator[str | LongLine]
    if ref.kind == "local":
        if os.path.isdir(ref.value):
            yield from _walk(Path(ref.value), limits, row)
            return
        if not ref.is_manifest:
            yield Entry("ref", ref.value, row=row, source="" if raw == ref.value else raw)
            return
        here: Path | str = Path(ref.value).parent
        lines = local_lines(Path(ref.value))
    elif ref.kind == "s3" and (ref.is_prefix or ref.is_manifest):
        if s3 is None:
            raise RefusedRef(f"no S3 client to expand {ref.value}")
        if ref.is_prefix:
            yield from _list_s3(s3, ref.bucket, ref.key, row)
            return
        directory = ref.key.rpartition("/")[0]
        here = f"s3://{ref.bucket}/{directory}/" if directory else f"s3://{ref.bucket}/"
        lines = s3_lines(s3, ref.bucket, ref.key)
    else:
        yield Entry("ref", ref.value, row=row)
        return
    if depth >= MAX_MANIFEST_DEPTH:
        yield _refused(ref.value, f"manifests nested deeper than {MAX_MANIFEST_DEPTH}: {ref.value}")
        return
    yield from _rows(lines, ref.value, suffix(ref.value) == ".csv", limits, s3, here, depth, row, dirs)


def _rows(lines: Iterator[str | LongLine], name: str, csv: bool, limits: LimitSettings, s3: Any | None,
          here: Path | str | None, depth: int, row: dict[str, Any] | None, dirs: dict[str, str]) -> Iterator[Entry]:
    for line_no, entry, extra in manifest_rows(lines, csv=csv):
        where = f"line {line_no} of {shown_ref(name)}"
        if isinstance(entry, LongLine):
            yield _refused(where, f"{where} has {entry.length:,} bytes: more than {MAX_LINE_BYTES:,} (not read)")
        elif entry is None:
            yield _refused(where, f"no reference on {where}")
        elif extra and len(json.dumps(extra, default=str)) > MAX_ROW_BYTES:
            yield _refused(where, f"extra columns over {MAX_ROW_BYTES} bytes on {where}")
        elif here is None and "://" not in entry and not entry.startswith("/"):
            yield _refused(entry, f"a relative path on {where}: an uploaded manifest has no folder (give "
                                  "absolute paths, s3:// keys or URLs)")
        else:
            yield from _expand(entry, limits, s3, here, depth + 1, extra or row, dirs)


def expand_uploaded(path: Path, csv: bool, name: str, limits: LimitSettings,
                    s3_client: Any | None = None) -> Iterator[Entry]:
    """The rows of a manifest a caller uploaded (the API's): the file is the caller's input, not
    a ref (its own path is not checked against the roots); its entries are checked as any are,
    and a relative one is refused (it has no folder to resolve against). ``name``: what
    messages call it."""
    yield from _rows(local_lines(path), name, csv, limits, s3_client, None, 0, None, {})


def _walk(top: Path, limits: LimitSettings, row: dict[str, Any] | None) -> Iterator[Entry]:
    """``top`` is resolved and confined; so is every directory pushed (its resolved path rides
    along), so an entry that is not a symlink is its directory's resolved path plus its name
    (no realpath walk per file), and only symlinks are parsed and confined again."""
    seen = {str(top)}
    stack: list[tuple[Iterator[os.DirEntry[str] | Entry], str]] = [(_entries(top), str(top))]
    while stack:
        listing, resolved_dir = stack[-1]
        entry = next(listing, None)
        if entry is None:
            stack.pop()
            continue
        if isinstance(entry, Entry):
            yield entry
            continue
        if entry.name.startswith("."):
            yield Entry("skipped", entry.path, "hidden")
            continue
        is_dir = entry.is_dir()
        if not is_dir and not entry.is_file():
            yield Entry("skipped", entry.path, "not a regular file")
            continue
        if not is_dir and suffix(entry.name) in MANIFEST_EXTENSIONS:
            yield Entry("skipped", entry.path, "a manifest inside a folder (pass it by name to expand it)")
            continue
        source = ""
        if entry.is_symlink():
            try:
                value = parse(entry.path, limits).value
            except RefusedRef as exc:  # a symlink out of the roots
                yield _refused(entry.path, str(exc))
                continue
            source = entry.path
        else:
            value = os.path.join(resolved_dir, entry.name)
        if is_dir:
            if value not in seen:  # symlink loops and aliases are entered once
                seen.add(value)
                stack.append((_entries(Path(entry.path)), value))
        else:
            yield Entry("ref", value, row=row, source=source, found=True)


def _entries(directory: Path) -> Iterator[os.DirEntry[str] | Entry]:
    # One directory's listing is held (to sort it), never the whole tree.
    try:
        with os.scandir(directory) as it:
            listing = sorted(it, key=lambda e: e.name)
    except OSError as exc:  # an unreadable subdirectory is recorded, the walk goes on
        yield _refused(str(directory), f"unreadable directory: {directory}: {exc.strerror}")
        return
    yield from listing


def _list_s3(s3: Any, bucket: str, prefix: str, row: dict[str, Any] | None) -> Iterator[Entry]:
    """Every object under the prefix; "folder" marker keys (ending in '/') are not objects."""
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", ()):
                key = obj["Key"]
                if key.endswith("/"):
                    continue
                value = f"s3://{bucket}/{key}"
                parts = key[len(prefix):].split("/")
                if any(part.startswith(".") for part in parts):
                    yield Entry("skipped", value, "hidden")
                elif suffix(parts[-1]) in MANIFEST_EXTENSIONS:
                    yield Entry("skipped", value, "a manifest inside a prefix (pass it by name to expand it)")
                else:
                    yield Entry("ref", value, row=row, found=True)
    except (ClientError, BotoCoreError, OSError) as exc:
        raise s3_error(exc, f"s3://{bucket}/{prefix}") from exc
