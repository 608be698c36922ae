"""Fetching one image reference's bytes, with a byte cap and typed errors (used by workers).

Local files are opened non-blocking and must be regular files inside the allowed roots (checked
again here: the worker is the security boundary). On Linux the check is made on the file actually
opened: an ``O_PATH`` handle (no device opened, no FIFO waited on), its resolved path read from
``/proc/self/fd``, then the same file reopened for reading. A symlink swapped between a check and
an open cannot point the read outside the roots, and no ``realpath`` walk (an ``lstat`` per path
component, in Python) is paid per image. Elsewhere: ``realpath``, check, then open.

S3 objects and HTTP(S) URLs are streamed and cut at ``limits.max_bytes``; a ``store:`` ref (an
inline image ocrq wrote, ``producer.inline_images``) is read from the result store, capped the same. Missing →
MissingObject (a host name that does not exist → HostNotFound), refused → RefusedRef, too big →
TooLarge, unreachable/5xx/throttled/DNS down → StorageUnavailable (retryable).
"""

from __future__ import annotations

import http.client
import os
import stat
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from botocore.exceptions import BotoCoreError, ClientError

from ocrq.errors import MissingObject, OcrqError, RefusedRef, StorageUnavailable, TooLarge
from ocrq.net.deadline import Deadline
from ocrq.net.pinned import PinnedHTTP, PinnedHTTPS
from ocrq.redact import redact_url
from ocrq.refs import _CHUNK, Ref, confine, parse
from ocrq.s3errors import s3_error
from ocrq.settings import LimitSettings

#: where Linux shows what a descriptor resolves to (None: not available, realpath instead)
_FD_DIR = "/proc/self/fd" if hasattr(os, "O_PATH") and os.path.isdir("/proc/self/fd") else None


def fetch(ref: str, limits: LimitSettings, s3_client: Any | None = None, store: Any | None = None,
          job: str | None = None) -> bytes:
    """Read one image's bytes, at most ``limits.max_bytes``, raising typed errors (``store``: the
    result store, for ``store:`` refs, which only the job that wrote them, ``job``, may read)."""
    parsed = parse(ref, limits, resolve=_FD_DIR is None)
    if parsed.kind == "store":
        if job is None or parsed.owner != job:
            raise RefusedRef(f"{parsed.value} is an inline image of another job: a job reads only its own")
        return _fetch_store(store, parsed, limits.max_bytes)
    if parsed.kind == "local":
        if _FD_DIR is None:
            return _fetch_local(parsed.value, limits.max_bytes)
        return _fetch_confined(parsed.value, ref, limits)
    if parsed.kind == "s3":
        if parsed.is_prefix:
            raise RefusedRef(f"not a single object: {ref}")
        if s3_client is None:
            raise RefusedRef(f"no S3 client configured for {ref}")
        return _fetch_s3(s3_client, parsed, limits.max_bytes)
    return _fetch_http(parsed.value, limits)


def _fetch_store(store: Any | None, parsed: Ref, cap: int) -> bytes:
    if store is None:
        raise RefusedRef(f"no store to read {parsed.value} from")
    data = store.get_many([parsed.key], raw=True).get(parsed.key)
    if data is None:
        raise MissingObject(f"no such inline image in the store: {parsed.value}")
    if len(data) > cap:
        raise TooLarge(f"{len(data)} bytes > {cap}: {parsed.value}")
    return bytes(data)


def _read_capped(read: Callable[[int], bytes], cap: int, ref: str,
                 deadline: float | None = None) -> bytes:
    parts: list[bytes] = []  # joined once (a single part is returned as it is: no copy)
    size = 0
    while chunk := read(min(_CHUNK, cap + 1 - size)):
        parts.append(chunk)
        size += len(chunk)
        if size > cap:
            raise TooLarge(f"more than {cap} bytes: {ref}")
        if deadline is not None and time.monotonic() > deadline:
            raise StorageUnavailable(f"timed out reading {ref}")
    return b"".join(parts)


def _fetch_confined(path: str, ref: str, limits: LimitSettings) -> bytes:
    """A local file confined on its descriptor (Linux): see the module docstring."""
    try:
        handle = os.open(path, os.O_PATH)
    except OSError as exc:
        # refused exactly as before when outside the roots (realpath: a loop, or an absent file
        # out there, is refused, not reported missing); otherwise the open's own error
        parse(ref, limits)
        raise _local_error(exc, path) from exc
    try:
        fd_path = f"{_FD_DIR}/{handle}"
        confine(os.readlink(fd_path), ref, limits)
        if not stat.S_ISREG(os.fstat(handle).st_mode):  # before a device inside the roots is opened
            raise RefusedRef(f"not a regular file: {path}")
        return _fetch_local(fd_path, limits.max_bytes, name=path)
    finally:
        os.close(handle)


def _fetch_local(path: str | Path, cap: int, name: str | Path | None = None) -> bytes:
    """``path``'s bytes (``name``: the path errors show)."""
    name = path if name is None else name
    try:
        # O_NONBLOCK: opening a FIFO must not hang a fetch thread (no effect on regular files)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:  # os.read on the descriptor: no buffered file object per image
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise RefusedRef(f"not a regular file: {name}")
            if info.st_size > cap:
                raise TooLarge(f"{info.st_size} bytes > {cap}: {name}")
            return _read_capped(lambda n: os.read(fd, n), cap, str(name))
        finally:
            os.close(fd)
    except OSError as exc:
        raise _local_error(exc, name) from exc


def _local_error(exc: OSError, name: str | Path) -> OcrqError:
    if isinstance(exc, FileNotFoundError | NotADirectoryError):
        return MissingObject(f"no such file: {name}")
    if isinstance(exc, PermissionError | IsADirectoryError):
        return RefusedRef(f"cannot read {name}: {exc.strerror}")
    return StorageUnavailable(f"cannot read {name}: {exc}")


def _fetch_s3(s3: Any, ref: Ref, cap: int) -> bytes:
    try:
        response = s3.get_object(Bucket=ref.bucket, Key=ref.key)
        body = response["Body"]
        try:
            size = response.get("ContentLength")
            if size is not None and size > cap:
                raise TooLarge(f"{size} bytes > {cap}: {ref.value}")
            return _read_capped(body.read, cap, ref.value)
        finally:
            body.close()
    except (ClientError, BotoCoreError, OSError) as exc:
        raise s3_error(exc, ref.value) from exc


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Counts redirects itself and refuses targets whose scheme is not allowed (every host is
    checked when it is connected to: ``ocrq.net.pinned``)."""

    max_repeats = max_redirections = 1 << 10  # our own count below is the limit

    def __init__(self, limit: int, schemes: frozenset[str]) -> None:
        self._limit = limit
        self._schemes = schemes

    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                         headers: http.client.HTTPMessage, newurl: str) -> urllib.request.Request | None:
        count = getattr(req, "ocrq_redirects", 0) + 1
        if urlsplit(newurl).scheme.lower() not in self._schemes:
            fp.close()
            raise RefusedRef(f"redirect to a refused scheme: {req.full_url} -> {newurl}")
        if count > self._limit:
            fp.close()
            raise RefusedRef(f"more than {self._limit} redirects: {req.full_url} -> {newurl}")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            new.ocrq_redirects = count  # type: ignore[attr-defined]
        return new


def _http_status_error(status: int, url: str) -> OcrqError:
    if status in (404, 410):
        return MissingObject(f"HTTP {status}: {url}")
    if status in (408, 425, 429) or status >= 500:
        return StorageUnavailable(f"HTTP {status}: {url}")
    return RefusedRef(f"HTTP {status}: {url}")  # 401/403, other 4xx, redirects we did not follow


def _fetch_http(url: str, limits: LimitSettings) -> bytes:
    """One deadline, ``limits.http_timeout``, for the whole fetch: connect (every redirect's),
    TLS handshake, headers and body (``ocrq.net.deadline``), so a server that drips bytes cannot hold
    a fetch thread past it; a body shorter than its Content-Length is an error, not an image."""
    with Deadline(limits.http_timeout) as deadline:
        try:
            data = _fetch_http_within(url, limits, deadline)
        except (OSError, http.client.HTTPException, StorageUnavailable) as exc:
            if deadline.expired:
                raise _too_slow(url, limits) from exc
            raise
        if deadline.expired:  # (a socket shut down reads as the end of a body without a length)
            raise _too_slow(url, limits)
        return data


def _too_slow(url: str, limits: LimitSettings) -> StorageUnavailable:
    return StorageUnavailable(f"no complete answer within http_timeout ({limits.http_timeout:g} s): {url}")


def _fetch_http_within(url: str, limits: LimitSettings, deadline: Deadline) -> bytes:
    schemes = frozenset(s.lower() for s in limits.allowed_schemes) & {"http", "https"}
    # every connection (redirects included) resolves its host once, refuses non-public addresses
    # unless limits.http_allow_private, and connects to one of the addresses it checked
    opener = urllib.request.build_opener(
        _Redirects(limits.http_max_redirects, schemes), PinnedHTTP(limits, deadline),
        PinnedHTTPS(limits, deadline),
    )
    request = urllib.request.Request(url, headers={"User-Agent": "ocrq"})
    try:
        with opener.open(request, timeout=limits.http_timeout) as response:
            length = response.headers.get("Content-Length", "")
            if length.strip().isdigit() and int(length) > limits.max_bytes:
                raise TooLarge(f"{int(length)} bytes > {limits.max_bytes}: {url}")
            # read1: return what has arrived, so the deadline is checked between arrivals
            data = _read_capped(response.read1, limits.max_bytes, url, deadline.at)
            if response.length:  # what Content-Length promised and the connection never brought
                raise StorageUnavailable(f"the body ended {response.length} bytes short of its Content-Length: {url}")
            return data
    except urllib.error.HTTPError as exc:
        exc.close()
        raise _http_status_error(exc.code, url) from exc
    except RefusedRef as exc:
        if redact_url(url) in str(exc):
            raise
        raise RefusedRef(f"{url}: {exc}") from exc
    except http.client.InvalidURL as exc:
        raise RefusedRef(f"malformed URL: {url}") from exc
    except (OSError, http.client.HTTPException) as exc:  # URLError, timeouts, resets, short reads
        raise StorageUnavailable(f"HTTP source unavailable: {url}: {exc}") from exc
