"""The submit plan: expand the inputs, check what the producer can check cheaply, and account for
every file before anything is published.

    plan = plan_intake(refs, limits, s3_client, worker_roots)
    print(plan.summary())        # "N accepted, K skipped, M refused"
    if plan.refused: ...          # a submission with any refused ref publishes nothing

Checks on each single-image ref, beyond what ``ocrq.refs.parse`` already refuses (malformed,
scheme, outside the producer's allowed roots, bucket not in ``limits.s3_buckets``):

* a local file must exist and be a regular file (one ``stat``);
* a local file must lie inside the roots of at least one live worker, when workers report theirs
  (``worker_roots``): the producer and the workers agree before anything is published;
* an ``http(s)`` host is resolved once per host: a name that does not exist (NXDOMAIN) or an
  address that is not public (unless ``limits.http_allow_private``) is refused; a lookup that
  fails for another reason (DNS down) is left to the worker.

S3 objects are not checked one by one (a HEAD per object is not cheap); a missing one fails on
the worker with ``MissingObject``.

Accepted refs are spooled to a temporary file (millions of refs do not sit in memory) and
de-duplicated (the same ref with the same manifest row counts once).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from ocrq.errors import OcrqError, StorageUnavailable
from ocrq.net.addresses import public_addresses
from ocrq.redact import redact_message, shown_ref
from ocrq.settings import LimitSettings
from producer.expand import Entry, expand_entries, expand_uploaded
from producer.name_filter import NameFilter

#: skipped/refused entries kept for display (all are counted)
SAMPLE = 200
#: accepted refs named otherwise (symlinks, relative paths) remembered to name a later duplicate
_NAMED = 10_000
ROOTS_HINT = ("allow the directory with OCRQ_LIMITS__ALLOWED_ROOTS='{roots}' for the producer and the "
              "workers (limits.allowed_roots), or restart the embedded stack with `ocrq down; ocrq up --allow {dir}`")


@dataclass(frozen=True)
class Uploaded:
    """A manifest file a caller uploaded: where it was spooled, its format, what to call it."""

    path: Path
    csv: bool
    name: str


@dataclass
class IntakePlan:
    """What a submission would publish, and what it leaves out, with reasons."""

    accepted: int = 0
    skipped: int = 0
    refused: int = 0
    #: the same ref (and row) named more than once: submitted once
    duplicates: int = 0
    skipped_sample: list[Entry] = field(default_factory=list)
    refused_sample: list[Entry] = field(default_factory=list)
    #: duplicates as named (a symlink to a file also listed, a file named twice), with the ref
    #: they were merged into as the reason
    merged_sample: list[Entry] = field(default_factory=list)
    _spool: IO[str] | None = None
    #: the first ref refused for its roots, whole (the samples show refs cut: ``sampled``)
    _roots_ref: str | None = None

    def summary(self) -> str:
        text = f"{self.accepted} accepted, {self.skipped} skipped, {self.refused} refused"
        return text + (f" ({self.duplicates} duplicate refs merged)" if self.duplicates else "")

    @classmethod
    def new(cls) -> IntakePlan:
        """An empty plan that ``accept`` fills (a submission built line by line, not expanded)."""
        return cls(_spool=tempfile.TemporaryFile("w+", encoding="utf-8"))  # noqa: SIM115 - owned by the plan

    def accept(self, ref: str, row: dict[str, Any] | None, spec: dict[str, Any] | None = None) -> None:
        """Add one accepted image; ``spec`` (``{"task", "params"}``): its own, over the submission's."""
        assert self._spool is not None
        entry: list[Any] = [ref, row] if spec is None else [ref, row, spec]
        self._spool.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")
        self.accepted += 1

    def entries(self) -> Iterator[tuple[str, dict[str, Any] | None]]:
        """The accepted (ref, row) pairs, in the order they were found."""
        for ref, row, _ in self.items():
            yield ref, row

    def items(self) -> Iterator[tuple[str, dict[str, Any] | None, dict[str, Any] | None]]:
        """The accepted (ref, row, spec) triples, in order (spec None: the submission's task)."""
        if self._spool is None:
            return
        self._spool.seek(0)
        for line in self._spool:
            ref, row, *spec = json.loads(line)
            yield ref, row, spec[0] if spec else None

    def lines(self) -> Iterator[str]:
        """The accepted entries as spooled (one JSON line each, in order): what identifies a
        submission (ocrq.jobs.feed.submission_id)."""
        if self._spool is None:
            return
        self._spool.seek(0)
        yield from self._spool

    def hint(self) -> str | None:
        """What to change when refs were refused for their roots, naming the directory."""
        if self._roots_ref is None:
            return None
        raw = self._roots_ref.removeprefix("file://")
        try:
            path = Path(raw).resolve()
            directory = path if path.is_dir() else path.parent
        except (OSError, RuntimeError, ValueError):
            directory = Path(raw).parent
        return ROOTS_HINT.format(roots=json.dumps([str(directory)]), dir=directory)

    def close(self) -> None:
        if self._spool is not None:
            self._spool.close()
            self._spool = None


def plan_intake(inputs: Iterable[str], limits: LimitSettings, s3_client: Any | None = None,
                worker_roots: Sequence[Path] | None = None, uploaded: Uploaded | None = None,
                match: NameFilter = NameFilter()) -> IntakePlan:
    """``uploaded``: a manifest the caller sent (the API's), planned after ``inputs``; ``match``:
    which files found in folders and prefixes are taken (``producer.name_filter``)."""
    plan = IntakePlan.new()
    seen: set[bytes] = set()
    named: dict[bytes, str] = {}
    hosts: dict[tuple[str, int], str | None] = {}
    roots = [Path(r) for r in worker_roots or ()]
    try:
        entries = expand_entries(inputs, limits, s3_client)
        if uploaded is not None:
            entries = chain(entries, expand_uploaded(uploaded.path, uploaded.csv, uploaded.name, limits, s3_client))
        for found in entries:
            entry = _judged(found, match, limits, roots, hosts)
            if entry.kind == "skipped":
                plan.skipped += 1
                if len(plan.skipped_sample) < SAMPLE:
                    plan.skipped_sample.append(sampled(entry))
            elif entry.kind == "refused":
                plan.refused += 1
                if plan._roots_ref is None and "allowed roots" in entry.reason:
                    plan._roots_ref = entry.value
                if len(plan.refused_sample) < SAMPLE:
                    plan.refused_sample.append(sampled(entry))
            else:
                line = json.dumps([entry.value, entry.row], ensure_ascii=False, default=str)
                digest = hashlib.sha256(line.encode()).digest()[:16]
                if digest in seen:
                    plan.duplicates += 1
                    if len(plan.merged_sample) < SAMPLE:
                        first = named.get(digest, entry.value)
                        plan.merged_sample.append(sampled(Entry("skipped", entry.source or entry.value,
                                                                f"the same file as {first}, submitted once")))
                    continue
                seen.add(digest)
                if entry.source and len(named) < _NAMED:  # what a later duplicate was merged into
                    named[digest] = entry.source
                plan.accepted += 1
                assert plan._spool is not None
                plan._spool.write(line + "\n")
    except BaseException:
        plan.close()
        raise
    return plan


def _judged(entry: Entry, match: NameFilter, limits: LimitSettings, roots: list[Path],
            hosts: dict[tuple[str, int], str | None]) -> Entry:
    """A ref as found, or skipped by ``match`` or refused by the producer's checks."""
    if entry.kind != "ref":
        return entry
    if entry.found and not match.takes(entry.source or entry.value):
        return Entry("skipped", entry.source or entry.value, match.reason())
    reason = _check(entry, limits, roots, hosts)
    return entry if reason is None else Entry("refused", entry.value, reason)


def sampled(entry: Entry) -> Entry:
    """An entry as a plan shows it (printed, answered by the API): its ref redacted and cut, its
    reason redacted (a 10 MB ref, or a URL's password, is never echoed)."""
    return Entry(entry.kind, shown_ref(entry.value), redact_message(entry.reason, 1000), entry.row, entry.source and
                 shown_ref(entry.source))


def check_ref(ref: str, limits: LimitSettings, worker_roots: Sequence[Path] | None = None,
              hosts: dict[tuple[str, int], str | None] | None = None) -> str | None:
    """Why the producer refuses the canonical single-image ``ref`` (what ``plan_intake`` checks
    beyond ``ocrq.refs.parse``), or None; ``hosts``: lookups to share across calls."""
    return _check(Entry("ref", ref), limits, [Path(r) for r in worker_roots or ()], {} if hosts is None else hosts)


def _check(entry: Entry, limits: LimitSettings, worker_roots: list[Path],
           hosts: dict[tuple[str, int], str | None]) -> str | None:
    """Why the producer refuses this single-image ref, or None."""
    ref = entry.value
    if ref.startswith("/"):
        return _check_local(ref, worker_roots)
    if ref.startswith(("http://", "https://")):
        parts = urlsplit(ref)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if (host, port) not in hosts:
            hosts[(host, port)] = _check_host(host, port, limits)
        return hosts[(host, port)]
    return None


def _check_local(path: str, worker_roots: list[Path]) -> str | None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return f"no such file: {path}"
    except OSError as exc:
        return f"cannot stat {path}: {exc.strerror}"
    if not stat.S_ISREG(info.st_mode):
        return f"not a regular file: {path}"
    # strings, not pathlib (the same answer as Path.is_relative_to; a canonical ref is resolved)
    if worker_roots and not any(path == str(root) or path.startswith(str(root).rstrip("/") + "/")
                                for root in worker_roots):
        listed = ", ".join(str(r) for r in worker_roots)
        return f"outside the allowed roots of the running workers ({listed}): {path}"
    return None


def _check_host(host: str, port: int, limits: LimitSettings) -> str | None:
    try:
        public_addresses(host, port, limits)
    except StorageUnavailable:  # DNS down, timeouts: not the URL's fault; the worker retries
        return None
    except OcrqError as exc:  # HostNotFound, a non-public address: the URL cannot work
        return str(exc)
    return None
