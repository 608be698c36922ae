"""The image-hash cache: Redis (hot, TTL) in front of the durable store (content-addressed).

A key is sha256(bytes) + engine revision + task + params (ocrq.keys.cache_key), so a hit is
exactly "this engine already read these bytes this way". Lookups are one MGET for a whole chunk,
then one batched store read (``get_many``) for the Redis misses (which also re-warm Redis); writes
are one batched store write (with the chunk's result documents), then one script that SETs them
all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import TypeAdapter

from ocrq import keys
from ocrq.errors import StorageUnavailable
from ocrq.results import OcrOutput
from ocrq.storage import ResultStore

Outputs = list[OcrOutput]


_OUTPUTS: TypeAdapter[Outputs] = TypeAdapter(Outputs)


def _dump(outputs: Outputs) -> bytes:
    """One JSON serialization per entry, shared by the durable and the hot copy."""
    return _OUTPUTS.dump_json(outputs)


def _load(raw: bytes) -> Outputs:
    return _OUTPUTS.validate_json(raw)


#: SET every key to its value with one TTL: a chunk's hot copies in one command and one reply
#: (a pipeline of SETs cost redis-py 5 packed arguments and one parsed reply per entry).
#: KEYS: the cache keys; ARGV: ttl seconds, then one value per key
_SET_ALL = """
for i, key in ipairs(KEYS) do
  redis.call('SET', key, ARGV[i + 1], 'EX', ARGV[1])
end
return #KEYS
"""


class ResultCache:
    def __init__(self, redis: Any, store: ResultStore, ttl: int) -> None:
        self.redis = redis
        self.store = store
        self.ttl = ttl
        self._set_all = redis.register_script(_SET_ALL)

    def get_many(self, cache_keys: Sequence[str]) -> dict[str, Outputs]:
        unique = list(dict.fromkeys(cache_keys))
        if not unique:
            return {}
        try:
            raw = self.redis.mget([keys.cache(k) for k in unique])
        except Exception as exc:  # redis.ConnectionError and friends
            raise StorageUnavailable(f"redis cache read: {exc}") from exc
        found = {k: _load(v) for k, v in zip(unique, raw, strict=True) if v}
        misses = [k for k in unique if k not in found]
        docs = self.store.get_many((keys.cache_object(k) for k in misses), raw=True) if misses else {}
        warm = {k: _load(d) for k in misses if (d := docs.get(keys.cache_object(k))) is not None}
        if warm:
            self._set_redis({k: docs[keys.cache_object(k)] for k in warm})
        found.update(warm)
        return found

    def put_many(self, entries: Mapping[str, Outputs], documents: Sequence[tuple[str, Any]] = ()) -> None:
        """Durable copy first, then the hot copy (a hot entry always has a durable one).
        ``documents``: other store writes of the chunk, stored in the same call (one SQLite
        transaction) as the durable copies."""
        encoded = {k: _dump(outs) for k, outs in entries.items()}
        writes = [(keys.cache_object(k), raw) for k, raw in encoded.items()] + list(documents)
        if writes:
            self.store.put_many(writes)
        if encoded:
            self._set_redis(encoded)

    def _set_redis(self, encoded: Mapping[str, bytes]) -> None:
        try:
            self._set_all(keys=[keys.cache(k) for k in encoded], args=[self.ttl, *encoded.values()])
        except Exception as exc:
            raise StorageUnavailable(f"redis cache write: {exc}") from exc
