"""The image-hash cache: a hot copy in Redis, bounded in bytes, in front of the durable store
(content-addressed, the cache of record).

A key is sha256(bytes) + engine revision + task + params (ocrq.keys.cache_key), so a hit is
exactly "this engine already read these bytes this way". Lookups are one Redis round trip for a
whole chunk, then one batched store read (``get_many``) for the Redis misses (which also re-warm
Redis); writes are the durable copies, stored by the chunk's store step in one call with its
result documents (``durable_writes``), then one script that adds the hot copies (``warm``).

The hot copy has its own byte budget (``redis.cache_max_bytes``), enforced here whatever server
holds it (``redis.cache_url``, default the broker's own): entries go into the current
generation (``keys.hot_generation``), a hash; once the entries written into it reach half the
budget, a new generation starts and the one before the current is deleted. At most two
generations live, so the hot copies never hold more than the budget (plus one chunk's entries),
and a dedicated cache server's own ``maxmemory``/``allkeys-lru`` is only a second line. What the
hot copy holds is an optimisation: a Redis that cannot be read or written costs store reads, never
a chunk (the durable copy is written first).

The scripts are given the keys they touch (``KEYS``): the generation this cache last saw current
and the one before it. When another generation has started since (another worker's write), the
script writes or reads nothing and says which one is current; the call is made again with its
keys (one more round trip per worker per generation).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import TypeAdapter

from ocrq import keys
from ocrq.broker import scripts
from ocrq.results import OcrOutput
from ocrq.store.storage import ResultStore

log = logging.getLogger("ocrq.cache")

Outputs = list[OcrOutput]

_OUTPUTS: TypeAdapter[Outputs] = TypeAdapter(Outputs)

#: bytes Redis spends on a hash entry besides its field and value (dict entry, string headers,
#: allocator rounding), counted against the budget with each entry
ENTRY_OVERHEAD = 96
#: seconds between two warnings about an unreachable hot cache
_WARN_EVERY_S = 60.0
#: calls of a script per lookup or write when generations start meanwhile (then: a miss, no copy)
_TRIES = 3


def _dump(outputs: Outputs) -> bytes:
    """One JSON serialization per entry, shared by the durable and the hot copy."""
    return _OUTPUTS.dump_json(outputs)


def _load(raw: bytes) -> Outputs:
    return _OUTPUTS.validate_json(raw)


class ResultCache:
    """``redis``: the client of the server that holds the hot copies (``redis.cache_url``);
    ``max_bytes`` 0 turns the hot copy off (every lookup goes to the store)."""

    def __init__(self, redis: Any, store: ResultStore, ttl: int, max_bytes: int) -> None:
        self.redis = redis
        self.store = store
        self.ttl = ttl
        self.max_bytes = max_bytes
        self._put = scripts.plain(redis, "hot_put")
        self._get = scripts.plain(redis, "hot_get")
        self._warned = 0.0
        #: the generation last seen current (a guess: the scripts check it)
        self._gen = 0

    def _keys(self, gen: int) -> list[str]:
        return [keys.HOT_STATE, keys.hot_generation(gen), keys.hot_generation(gen - 1)]

    def _read(self, unique: list[str]) -> list[bytes | None]:
        """The hot copies of ``unique`` (None where there is none), from the current generation
        or the one before it."""
        for _ in range(_TRIES):
            gen = self._gen
            raw = self._get(keys=self._keys(gen), args=[gen, *unique])
            self._gen = int(raw[0])
            if len(raw) > 1:
                return list(raw[1:])
        return [None] * len(unique)

    def _write(self, args: list[Any]) -> None:
        """``(cache key, value)`` pairs (``args``) into the current generation."""
        for _ in range(_TRIES):
            gen = self._gen
            written, self._gen = (int(x) for x in self._put(keys=self._keys(gen), args=[gen, *args]))
            if written:
                return

    def get_many(self, cache_keys: Sequence[str], reads: list[int] | None = None) -> dict[str, Outputs]:
        """The outputs cached for ``cache_keys`` (found ones only). ``reads``: the store reads
        this made (the hot copy's misses) are appended to it."""
        unique = list(dict.fromkeys(cache_keys))
        if not unique:
            return {}
        found: dict[str, Outputs] = {}
        if self.max_bytes > 0:
            try:
                found = {k: _load(v) for k, v in zip(unique, self._read(unique), strict=True) if v}
            except Exception as exc:  # redis.ConnectionError and friends: the store answers instead
                self._warn("read", exc)
        misses = [k for k in unique if k not in found]
        if reads is not None:
            reads.append(len(misses))
        docs = self.store.get_many((keys.cache_object(k) for k in misses), raw=True) if misses else {}
        warm = {k: _load(d) for k in misses if (d := docs.get(keys.cache_object(k))) is not None}
        if warm:
            self._set_redis({k: docs[keys.cache_object(k)] for k in warm})
        found.update(warm)
        return found

    def put_many(self, entries: Mapping[str, Outputs]) -> None:
        """Durable copy first, then the hot copy (a hot entry always has a durable one)."""
        encoded = self.encode(entries)
        if encoded:
            self.store.put_many(self.durable_writes(encoded))
            self.warm(encoded)

    @staticmethod
    def encode(entries: Mapping[str, Outputs]) -> dict[str, bytes]:
        """Each entry's JSON, once: the durable and the hot copy share it."""
        return {k: _dump(outs) for k, outs in entries.items()}

    @staticmethod
    def durable_writes(encoded: Mapping[str, bytes]) -> list[tuple[str, Any]]:
        """The store writes of ``encoded``'s durable copies (the caller stores them, with the
        chunk's other writes in the same call: the store step, worker.chunk.store)."""
        return [(keys.cache_object(k), raw) for k, raw in encoded.items()]

    def warm(self, encoded: Mapping[str, bytes]) -> None:
        """The hot copies of entries whose durable copies are stored (best effort)."""
        self._set_redis(encoded)

    def _set_redis(self, encoded: Mapping[str, bytes]) -> None:
        if self.max_bytes <= 0:
            return
        args: list[Any] = [self.max_bytes // 2, self.ttl, ENTRY_OVERHEAD]
        for key, value in encoded.items():
            args += [key, value]
        try:
            self._write(args)
        except Exception as exc:  # a full or unreachable cache Redis: the durable copy stands
            self._warn("write", exc)

    def _warn(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            log.warning("hot cache %s failed (the store's copy is used; next warning in %.0f s): %s",
                        what, _WARN_EVERY_S, exc)
