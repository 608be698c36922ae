"""Manifests: the lines of a ``.jsonl`` or ``.csv`` file (local or on S3), streamed, as
(line number, ref, row) — what ``ocrq.expand`` expands a manifest into.

* JSONL: one JSON object per line with a ``ref``/``path``/``url``/``uri`` field (the first one
  present), or a bare JSON string. The object's other fields are the row.
* CSV: the first of those columns when the first row names one (a header), else the first column
  of every row. With a header, the other named columns are the row (as the text they are).

A line without a usable ref comes back as ``ref=None`` (the caller refuses it, naming the line);
blank lines are ignored. A manifest that cannot be read raises its typed error: missing →
MissingObject, not readable / S3 refused → RefusedRef, I/O or S3 down → StorageUnavailable
(S3 answers through ``ocrq.s3errors``).
"""

from __future__ import annotations

import csv as _csv
import io
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from ocrq.errors import MissingObject, RefusedRef, StorageUnavailable
from ocrq.s3errors import s3_error

MANIFEST_EXTENSIONS = frozenset({".jsonl", ".csv"})
REF_FIELDS = ("ref", "path", "url", "uri")
#: a manifest row's extra columns (JSON) above this are refused: they travel in every message
MAX_ROW_BYTES = 16 * 1024
_BUFFER = 1 << 16

#: (line number, ref or None, the row's other fields or None)
Row = tuple[int, str | None, dict[str, Any] | None]


def local_lines(path: Path) -> Iterator[str]:
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


def s3_lines(s3: Any, bucket: str, key: str) -> Iterator[str]:
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"]
        raw = io.BufferedReader(_BodyReader(body), _BUFFER)
        with io.TextIOWrapper(raw, encoding="utf-8-sig", errors="replace", newline="") as text:
            yield from text
    except (ClientError, BotoCoreError, OSError) as exc:
        raise s3_error(exc, f"s3://{bucket}/{key}") from exc


def manifest_rows(lines: Iterable[str], *, csv: bool) -> Iterator[Row]:
    return _csv_rows(lines) if csv else _jsonl_rows(lines)


def _jsonl_rows(lines: Iterable[str]) -> Iterator[Row]:
    for line_no, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        extra = None
        if isinstance(value, dict):
            field = next((f for f in REF_FIELDS if isinstance(value.get(f), str)), None)
            extra = {k: v for k, v in value.items() if k != field} or None
            value = value[field] if field else None
        ref = value.strip() if isinstance(value, str) and value.strip() else None
        yield line_no, ref, extra


def _csv_rows(lines: Iterable[str]) -> Iterator[Row]:
    reader = _csv.reader(lines)
    column = 0
    header: list[str] = []
    first = True
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except _csv.Error:  # e.g. a field over csv.field_size_limit: that line only
            yield reader.line_num, None, None
            continue
        if first:
            first = False
            names = [cell.strip().lower() for cell in row]
            found = next((names.index(f) for f in REF_FIELDS if f in names), None)
            if found is not None:
                column = found
                header = [cell.strip() for cell in row]
                continue
        if not any(cell.strip() for cell in row):
            continue
        value = row[column].strip() if column < len(row) else ""
        # with a header, the other named columns come back in the result (as the text they are)
        extra = {name: row[i] for i, name in enumerate(header) if i != column and name and i < len(row)}
        yield reader.line_num, value or None, extra or None
