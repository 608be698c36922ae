"""Image references: parsing, confinement to allowed roots, and expansion (``expand_entries``)
for producers (workers read the bytes with ``ocrq.fetch``).

A reference is a local path (absolute, relative, or ``file://``), ``s3://bucket/key``, or an
``http(s)://`` URL. Containers expand to single-image refs:

* a local directory: every regular file in it, whatever its name (the worker sniffs the content:
  magic bytes, not the extension), depth first in name order. Skipped, counted and listed: hidden
  entries (``.name``, and everything under a hidden directory), manifests found inside a folder,
  and entries that are not regular files (FIFOs, sockets, broken symlinks). A symlinked
  directory is entered once.
* ``s3://bucket/prefix/`` (trailing slash, or the bare bucket): every object under it (paginated),
  with the same rule for hidden path components and manifests; "folder" marker keys ending in
  ``/`` are not objects.
* a manifest (``.jsonl`` or ``.csv``, local or on S3), streamed line by line (formats:
  ``ocrq.manifests``). A row's other fields (``id``, ``metadata``, any column) travel with its
  ref into the result, unchanged. Relative entries resolve against the manifest's own directory
  (or S3 "directory"); entries may themselves be directories, prefixes or manifests (nesting is
  capped).

Canonical refs are absolute resolved local paths (no ``file://``), ``s3://bucket/key`` and URLs.

Nothing is silently lost: every file found is an ``Entry`` — a ref, skipped (with the rule that
skipped it), or refused (malformed, scheme, outside the allowed roots, bucket not allowed,
unreadable directory, a manifest line without a usable ref). Producers refuse a submission with
any refused entry before publishing anything (``ocrq.intake``). A container that cannot be read
at all (missing manifest or bucket, S3 down) raises its typed error instead.

Confinement is enforced again by ``fetch`` (the worker is the boundary: anyone who can write to
the broker can submit any string), on Linux on the opened file itself.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from botocore.exceptions import BotoCoreError, ClientError

from ocrq.errors import RefusedRef
from ocrq.manifests import MANIFEST_EXTENSIONS, MAX_ROW_BYTES, local_lines, manifest_rows, s3_lines
from ocrq.redact import redact_text
from ocrq.s3errors import s3_error
from ocrq.settings import LimitSettings

BAD_REF_PREFIX = "invalid:"
#: longer references are refused (RefusedRef): keeps every chunk message within its size cap
MAX_REF_CHARS = 8192
#: a manifest may list manifests this deep (also stops a manifest that lists itself)
MAX_MANIFEST_DEPTH = 3
#: resolved directories one expansion keeps (``_resolve``)
_MAX_DIRS = 10_000
_CHUNK = 1 << 16
# Two or more characters so a Windows drive letter is not a scheme; a relative local name with a
# colon needs "./" (as in RFC 3986).
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")


@dataclass(frozen=True)
class Ref:
    """One parsed, confined reference (``value`` is its canonical string)."""

    kind: Literal["local", "s3", "http"]
    value: str
    bucket: str = ""
    key: str = ""

    @functools.cached_property
    def path(self) -> Path | None:
        """A local ref's resolved path (built when asked for: most refs only need ``value``)."""
        return Path(self.value) if self.kind == "local" else None

    @property
    def is_prefix(self) -> bool:
        return self.kind == "s3" and (not self.key or self.key.endswith("/"))

    @property
    def is_manifest(self) -> bool:
        name = os.path.basename(self.value) if self.kind == "local" else self.key
        return self.kind != "http" and not self.is_prefix and _suffix(name) in MANIFEST_EXTENSIONS


def _suffix(name: str) -> str:
    dot = name.rfind(".")
    return name[dot:].lower() if dot > 0 and "/" not in name[dot:] else ""


def parse(ref: str, limits: LimitSettings, base: Path | str | None = None, *, resolve: bool = True,
          dirs: dict[str, str] | None = None) -> Ref:
    """Parse and confine one reference, or raise ``RefusedRef``.

    ``base`` is where a relative entry resolves: a local directory, or ``s3://bucket/dir/`` for
    entries of a manifest stored on S3 (default: the current directory). ``resolve=False``: a
    local ref is only made absolute, neither resolved nor confined; the caller confines the file
    it opens (``ocrq.fetch`` does, on the descriptor). ``dirs``: resolved directories to reuse
    (one expansion's: ``_resolve``).
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
        return _local(text, text, limits, base, resolve, dirs)
    scheme = match.group(1).lower()
    if text.startswith(BAD_REF_PREFIX):
        raise RefusedRef(text[len(BAD_REF_PREFIX):])
    if scheme not in {s.lower() for s in limits.allowed_schemes}:
        raise RefusedRef(f"scheme {scheme!r} is not allowed: {text}")
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise RefusedRef(f"malformed file reference: {text}")
        return _local(unquote(parts.path), text, limits, base, resolve, dirs)
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
def _resolved_roots(roots: tuple[Path, ...], cwd: str) -> tuple[Path, ...]:
    # resolved once per (roots, cwd), not once per reference: submit streams millions of refs
    return tuple(r.resolve() for r in (roots or (Path(cwd),)))


@functools.lru_cache(maxsize=64)
def _root_prefixes(roots: tuple[Path, ...], cwd: str) -> tuple[tuple[str, str], ...]:
    """(root, root + "/") strings: a path lies in a root when it is the root or starts with the
    second (the same answer as ``Path.is_relative_to``, without building paths per reference)."""
    return tuple((str(r), str(r).rstrip("/") + "/") for r in _resolved_roots(roots, cwd))


def confine(resolved: str, raw: str, limits: LimitSettings) -> None:
    """``RefusedRef`` unless the resolved path ``resolved`` (of reference ``raw``) lies in one of
    the allowed roots."""
    _confine(resolved, raw, _root_prefixes(tuple(limits.allowed_roots), os.getcwd()))


def effective_roots(limits: LimitSettings) -> tuple[Path, ...]:
    """The resolved roots local refs must lie in (the current directory when none is set)."""
    return _resolved_roots(tuple(limits.allowed_roots), os.getcwd())


def _local(path: str, raw: str, limits: LimitSettings, base: Path | str | None, resolve: bool = True,
           dirs: dict[str, str] | None = None) -> Ref:
    # strings and os.path, not pathlib: a reference is parsed by the producer and again by the
    # worker, and pathlib's objects cost 5x the realpath itself (docs/bench/overhead.md)
    cwd = os.getcwd()
    text = path
    if not os.path.isabs(text):
        text = os.path.join(os.fspath(base) if isinstance(base, Path) else cwd, text)
    if not resolve:
        return Ref("local", text)
    try:
        resolved = _resolve(text, dirs)  # follows symlinks and '..' before the roots are checked
        roots = _root_prefixes(tuple(limits.allowed_roots), cwd)
    except (OSError, RuntimeError) as exc:  # symlink loops
        raise RefusedRef(f"unresolvable path: {raw}") from exc
    _confine(resolved, raw, roots)
    return Ref("local", resolved)


def _confine(resolved: str, raw: str, roots: tuple[tuple[str, str], ...]) -> None:
    if not any(resolved == root or resolved.startswith(prefix) for root, prefix in roots):
        listed = ", ".join(root for root, _ in roots)
        # a symlink inside a root names where it leads: that is what lies outside
        target = "" if resolved == raw else f" (resolves to {resolved})"
        raise RefusedRef(f"outside allowed roots ({listed}): {raw}{target}")


def _resolve(text: str, dirs: dict[str, str] | None) -> str:
    """``realpath`` with a symlink loop raising. With ``dirs`` (the directories one expansion has
    resolved), a file that is not itself a symlink costs one ``lstat``: its resolved path is its
    resolved directory's plus its name (realpath walks every component, an ``lstat`` each, in
    Python: the producer's largest cost per listed file, docs/bench/overhead.md). The worker
    confines what it opens on its own, so one submit reusing what it resolved moments ago changes
    no decision."""
    if dirs is not None:
        head, tail = os.path.split(text)
        try:
            plain = tail not in ("", ".", "..") and not stat.S_ISLNK(os.lstat(text).st_mode)
        except OSError:
            plain = False  # absent or unreadable: the full walk says how
        if plain:
            if (directory := dirs.get(head)) is None:
                if len(dirs) >= _MAX_DIRS:
                    dirs.clear()
                directory = dirs[head] = os.path.realpath(head)
                _check_loop(directory)
            return os.path.join(directory, tail)
    resolved = os.path.realpath(text)
    _check_loop(resolved)
    return resolved


def _check_loop(resolved: str) -> None:
    """What ``Path.resolve`` adds to ``realpath``: a symlink loop raises (realpath, not strict,
    returns a path inside the loop)."""
    try:
        os.stat(resolved)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RuntimeError(f"Symlink loop from {exc.filename!r}") from exc


def is_local(ref: str) -> bool:
    """Whether a reference names a local file (a path or ``file://``), without parsing it."""
    match = _SCHEME.match(ref)
    return match is None or match.group(1).lower() == "file"


def canonical(ref: str, limits: LimitSettings) -> str:
    """The canonical form of one reference (``RefusedRef`` if refused): for fail-fast checks."""
    return parse(ref, limits).value


# --- expansion ---------------------------------------------------------------------------------

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
    lines: Iterator[str]
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
    for line_no, entry, extra in manifest_rows(lines, csv=_suffix(ref.value) == ".csv"):
        where = f"line {line_no} of {ref.value}"
        if entry is None:
            yield _refused(where, f"no reference on {where}")
        elif extra and len(json.dumps(extra, default=str)) > MAX_ROW_BYTES:
            yield _refused(where, f"extra columns over {MAX_ROW_BYTES} bytes on {where}")
        else:
            yield from _expand(entry, limits, s3, here, depth + 1, extra or row, dirs)


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
        if not is_dir and _suffix(entry.name) in MANIFEST_EXTENSIONS:
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
            yield Entry("ref", value, row=row, source=source)


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
                elif _suffix(parts[-1]) in MANIFEST_EXTENSIONS:
                    yield Entry("skipped", value, "a manifest inside a prefix (pass it by name to expand it)")
                else:
                    yield Entry("ref", value, row=row)
    except (ClientError, BotoCoreError, OSError) as exc:
        raise s3_error(exc, f"s3://{bucket}/{prefix}") from exc
