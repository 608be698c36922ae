"""Image references: parsing and confinement to the allowed roots (producers, and workers through
``ocrq.net.fetch``); ``producer.expand`` turns containers into single-image refs.

A reference is a local path (absolute, relative, or ``file://``), ``s3://bucket/key``, an
``http(s)://`` URL, or ``store:inputs/{job}/{sha256}``: an image ocrq itself wrote to its store for
job ``job`` (a ``data:`` URI of an OpenAI Batch line, ``producer.inline_images``), which only that
job's chunks may read (``ocrq.net.fetch``). Canonical refs are absolute
resolved local paths (no ``file://``), ``s3://bucket/key``, URLs and ``store:`` refs.
Refused (``RefusedRef``): malformed, too long, a scheme not allowed, a URL with a user name or
password in it (``https://alice:pw@host/a.png``: a credential would travel in every message and
record), a local path outside the allowed roots (symlinks and ``..`` followed first), a bucket not
allowed, a ``store:`` ref to anything but an inline input.

Confinement is enforced again by ``fetch`` (the worker is the boundary: anyone who can write to
the broker can submit any string), on Linux on the opened file itself.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

from ocrq import names
from ocrq.errors import RefusedRef
from ocrq.redact import redact_text
from ocrq.settings import LimitSettings

BAD_REF_PREFIX = "invalid:"
#: a ref with one of these suffixes is a manifest of refs (``producer.manifests``), not an image
MANIFEST_EXTENSIONS = frozenset({".jsonl", ".csv"})
#: longer references are refused (RefusedRef): keeps every chunk message within its size cap
MAX_REF_CHARS = 8192
#: resolved directories one expansion keeps (``_resolve``)
_MAX_DIRS = 10_000
_CHUNK = 1 << 16
# Two or more characters so a Windows drive letter is not a scheme; a relative local name with a
# colon needs "./" (as in RFC 3986).
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
#: a ``store:`` ref names an inline input and nothing else in the store (not results, not cache)
STORE_SCHEME = "store"
_STORE_KEY = re.compile(rf"inputs/(?P<job>(?:{names.TENANT_PATTERN}{names.SEPARATOR})?{names.JOB_PATTERN})"
                        r"/[0-9a-f]{64}")


@dataclass(frozen=True)
class Ref:
    """One parsed, confined reference (``value`` is its canonical string)."""

    kind: Literal["local", "s3", "http", "store"]
    value: str
    bucket: str = ""
    key: str = ""
    #: a ``store:`` ref: the job whose inline image it is (only that job's chunks may read it)
    owner: str = ""

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
        return self.kind != "http" and not self.is_prefix and suffix(name) in MANIFEST_EXTENSIONS


def suffix(name: str) -> str:
    dot = name.rfind(".")
    return name[dot:].lower() if dot > 0 and "/" not in name[dot:] else ""


def parse(ref: str, limits: LimitSettings, base: Path | str | None = None, *, resolve: bool = True,
          dirs: dict[str, str] | None = None) -> Ref:
    """Parse and confine one reference, or raise ``RefusedRef``.

    ``base`` is where a relative entry resolves: a local directory, or ``s3://bucket/dir/`` for
    entries of a manifest stored on S3 (default: the current directory). ``resolve=False``: a
    local ref is only made absolute, neither resolved nor confined; the caller confines the file
    it opens (``ocrq.net.fetch`` does, on the descriptor). ``dirs``: resolved directories to reuse
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
    if scheme == STORE_SCHEME:
        return _store(text)
    if scheme in ("http", "https"):
        return _http(text)
    raise RefusedRef(f"scheme {scheme!r} is not supported: {text}")


def _http(text: str) -> Ref:
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise RefusedRef(f"malformed URL: {text}") from exc
    if not parts.hostname:
        raise RefusedRef(f"malformed URL: {text}")
    if "@" in parts.netloc:
        # refused, not fetched: a password would travel in every message, record and log line
        # that names the ref (and urllib would send the user name to DNS as part of the host)
        raise RefusedRef(f"a URL with a user name or password in it is refused: {text} (use a presigned URL, "
                         "or s3:// with the workers' own credentials)")
    return Ref("http", text)


def _store(text: str) -> Ref:
    key = text[len(STORE_SCHEME) + 1:]
    if not (match := _STORE_KEY.fullmatch(key)):
        raise RefusedRef(f"malformed store reference (store:inputs/{{job}}/{{sha256}} only): {redact_text(text[:100])}")
    return Ref("store", f"{STORE_SCHEME}:{key}", key=key, owner=match.group("job"))


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
