"""Manifests: the lines of a ``.jsonl`` or ``.csv`` file (local or on S3), streamed, as
(line number, ref, row) — what ``producer.expand`` expands a manifest into.

* JSONL: one JSON object per line with a ``ref``/``path``/``url``/``uri`` field (the first one
  present), or a bare JSON string. The object's other fields are the row.
* CSV: the first of those columns when the first row names one (a header), else the first column
  of every row. With a header, the other named columns are the row (as the text they are).

A line without a usable ref comes back as ``ref=None`` (the caller refuses it, naming the line);
a line over ``MAX_LINE_BYTES`` as a ``LongLine`` (its length: it is read through in blocks, never
held, ``producer.lines``); blank lines are ignored. A manifest that cannot be read raises its typed error: missing →
MissingObject, not readable / S3 refused → RefusedRef, I/O or S3 down → StorageUnavailable
(S3 answers through ``ocrq.s3errors``).
"""

from __future__ import annotations

import csv as _csv
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from ocrq.errors import MissingObject, RefusedRef, StorageUnavailable
from ocrq.s3errors import s3_error
from producer.lines import LongLine, text_lines

REF_FIELDS = ("ref", "path", "url", "uri")
#: a manifest line above this is refused unread (a ref of 8,192 characters and a row of
#: MAX_ROW_BYTES fit, with room for JSON's escapes)
MAX_LINE_BYTES = 64 * 1024

#: (line number, ref or None (a LongLine: a line over MAX_LINE_BYTES), the row's other fields or None)
Row = tuple[int, str | LongLine | None, dict[str, Any] | None]


def local_lines(path: Path) -> Iterator[str | LongLine]:
    try:
        with open(path, "rb") as handle:
            yield from text_lines(handle.read, MAX_LINE_BYTES)
    except FileNotFoundError as exc:
        raise MissingObject(f"manifest not found: {path}") from exc
    except PermissionError as exc:
        raise RefusedRef(f"manifest not readable: {path}") from exc
    except OSError as exc:
        raise StorageUnavailable(f"cannot read manifest {path}: {exc}") from exc


def s3_lines(s3: Any, bucket: str, key: str) -> Iterator[str | LongLine]:
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"]
        try:
            yield from text_lines(body.read, MAX_LINE_BYTES)
        finally:
            body.close()
    except (ClientError, BotoCoreError, OSError) as exc:
        raise s3_error(exc, f"s3://{bucket}/{key}") from exc


def manifest_rows(lines: Iterable[str | LongLine], *, csv: bool) -> Iterator[Row]:
    return _csv_rows(lines) if csv else _jsonl_rows(lines)


def _jsonl_rows(lines: Iterable[str | LongLine]) -> Iterator[Row]:
    for line_no, line in enumerate(lines, 1):
        if isinstance(line, LongLine):
            yield line_no, line, None
            continue
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


def _csv_rows(lines: Iterable[str | LongLine]) -> Iterator[Row]:
    long_lines: list[tuple[int, LongLine]] = []

    def physical() -> Iterator[str]:  # a long line reaches the CSV reader as a blank one
        for n, line in enumerate(lines, 1):
            if isinstance(line, LongLine):
                long_lines.append((n, line))
                yield "\n"
            else:
                yield line

    reader = _csv.reader(physical())
    column = 0
    header: list[str] = []
    first = True
    while True:
        try:
            row = next(reader)
        except StopIteration:
            for n, long in long_lines:
                yield n, long, None
            return
        except _csv.Error:  # e.g. a field over csv.field_size_limit: that line only
            yield reader.line_num, None, None
            continue
        while long_lines:
            n, long = long_lines.pop(0)
            yield n, long, None
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
