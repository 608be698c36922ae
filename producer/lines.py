"""The lines of a file or a stream, each capped before it is read whole: what every line reader
of ocrq uses (manifests, OpenAI Batch input files).

A line longer than the cap is never held: it is read through in blocks of ``_BLOCK`` bytes up to
its newline and comes back as a ``LongLine`` (its length only), so a manifest of one 10 GB line
costs a pass over it, not 10 GB of memory, and the error names its length, never its content.
Lines are split on ``\\n`` (``\\r\\n`` keeps its ``\\r``, which JSON and CSV readers accept).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

#: bytes read at a time
_BLOCK = 1 << 16


@dataclass(frozen=True)
class LongLine:
    """A line over the cap: its length in bytes (newline included), nothing of its content."""

    length: int


def capped_lines(read: Callable[[int], bytes], cap: int, digest: Any | None = None) -> Iterator[bytes | LongLine]:
    """Every line of what ``read(n)`` returns (``b""`` at the end), with its newline, or a
    ``LongLine`` where one is longer than ``cap`` bytes. ``digest``: a hashlib object fed every
    byte read (a whole file's digest, long lines included)."""
    pending = bytearray()
    long_length = -1  # ≥ 0 while reading through a long line: its bytes so far
    while True:
        block = read(_BLOCK)
        if not block:
            break
        if digest is not None:
            digest.update(block)
        start = 0
        while start < len(block):
            end = block.find(b"\n", start)
            stop = len(block) if end < 0 else end + 1
            if long_length >= 0:
                long_length += stop - start
            else:
                pending += block[start:stop]
                if len(pending) > cap:
                    long_length, pending = len(pending), bytearray()
            start = stop
            if end >= 0:
                if long_length >= 0:
                    yield LongLine(long_length)
                    long_length = -1
                else:
                    yield bytes(pending)
                    pending.clear()
    if long_length >= 0:
        yield LongLine(long_length)
    elif pending:
        yield bytes(pending)


def text_lines(read: Callable[[int], bytes], cap: int) -> Iterator[str | LongLine]:
    """``capped_lines`` decoded as UTF-8 (undecodable bytes replaced; a leading BOM dropped)."""
    first = True
    for line in capped_lines(read, cap):
        if isinstance(line, LongLine):
            yield line
        else:
            text = line.decode("utf-8", errors="replace")
            yield text.removeprefix("\ufeff") if first else text
        first = False
