"""One attempt at a chunk, as a value that moves forward through the steps (worker.chunk):

    Attempt.begin → fetch → check_cache → decode → infer → store (→ a ChunkReport)

Each step takes the attempt and returns a new one holding what it found (``dataclasses.replace``,
its findings read-only); nothing is changed in place. An image that fails at a step is in
``errors`` from then on and goes no further; the store step settles it (another attempt, or
failed for good).

The images' units are what the cache is keyed by: a plain image file is one unit (all its
frames), a PDF one unit per page, keyed by the page's pixels (worker.decoding.documents), so a
page is a hit whatever document it is in.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from ocrq.errors import OcrqError
from ocrq.messages import Chunk, Item
from ocrq.results import OcrOutput
from worker.decoding.page import Page

#: (image id, unit number): one cache entry of one image (a file, or one page of a PDF)
UnitId = tuple[str, int]

_EMPTY: Mapping[Any, Any] = MappingProxyType({})


def _empty() -> Mapping[Any, Any]:
    return _EMPTY

K = TypeVar("K")
V = TypeVar("V")


def frozen(mapping: dict[K, V]) -> Mapping[K, V]:
    """A step's findings as the next attempt holds them: read-only."""
    return MappingProxyType(mapping)


@dataclass(frozen=True)
class Unit:
    """What one cache entry covers: a whole image file (all its frames), or one PDF page."""

    cache_key: str
    #: its decoded pages (a plain image's: none until its cache miss is decoded)
    pages: tuple[Page, ...] = ()


@dataclass(frozen=True)
class Fetched:
    """One image of the chunk, fetched and hashed (a PDF rendered)."""

    item: Item
    sha256: str
    units: tuple[Unit, ...]
    #: a plain image's bytes, until the decode step (decoded on a miss, dropped on a hit)
    data: bytes = b""
    #: a PDF: rendered when fetched, one unit per page keyed by its pixels
    document: bool = False

    @property
    def cache_key(self) -> str | None:
        """The file's cache key (None for a PDF: each page has its own, in its output's meta)."""
        return None if self.document else self.units[0].cache_key


@dataclass(frozen=True)
class Attempt:
    chunk: Chunk
    #: when it began (monotonic seconds): its deadline and its duration count from there
    started: float
    #: images that failed at a step (the message's refused ones first), by image id
    errors: Mapping[str, OcrqError] = field(default_factory=_empty)
    #: how many of ``errors`` the message itself refused (``ocrq.messages.read_chunk``)
    refused: int = 0
    #: fetch: the images fetched and hashed (PDFs rendered), by image id
    images: Mapping[str, Fetched] = field(default_factory=_empty)
    #: check_cache: the outputs of the cache keys that hit
    hits: Mapping[str, list[OcrOutput]] = field(default_factory=_empty)
    #: check_cache: units that hit (a key twice in the chunk counts twice), and the store reads made
    unit_hits: int = 0
    store_reads: int = 0
    #: decode: plain images that missed the cache and were decoded
    decoded: int = 0
    #: infer: the engine's outputs per unit that missed, which of them another request already had
    #: in flight (not this chunk's engine work), and how many units went to the engine loop
    computed: Mapping[UnitId, list[OcrOutput]] = field(default_factory=_empty)
    shared: frozenset[UnitId] = frozenset()
    engine_units: int = 0

    @classmethod
    def begin(cls, chunk: Chunk, refused: Mapping[str, OcrqError] | None = None) -> Attempt:
        return cls(chunk, time.monotonic(), frozen(dict(refused or {})), len(refused or {}))

    def failed(self, errors: Mapping[str, OcrqError]) -> Mapping[str, OcrqError]:
        """``errors`` with this step's new ones added."""
        return frozen({**self.errors, **errors})

    def units(self) -> Iterator[tuple[str, int, Unit]]:
        """(image id, unit number, unit) of every image fetched, in chunk order."""
        for image_id, image in self.images.items():
            for n, unit in enumerate(image.units):
                yield image_id, n, unit

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def tag(self) -> str:
        """How the log lines name the chunk."""
        return f"job={self.chunk.job} n={len(self.chunk.items)}"
