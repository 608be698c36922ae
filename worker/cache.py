"""The image-hash cache: Redis (hot, TTL) in front of the durable store (content-addressed).

A key is sha256(bytes) + engine revision + task + params (ocrq.keys.cache_key), so a hit is
exactly "this engine already read these bytes this way". Lookups are one MGET for a whole chunk,
then store reads only for the Redis misses (which also re-warm Redis).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ocrq import keys
from ocrq.errors import StorageUnavailable
from ocrq.results import OcrOutput
from ocrq.storage import ResultStore

Outputs = list[OcrOutput]


def _dump(outputs: Outputs) -> list[dict[str, Any]]:
    return [o.model_dump(mode="json") for o in outputs]


def _load(doc: Any) -> Outputs:
    return [OcrOutput.model_validate(d) for d in doc]


class ResultCache:
    def __init__(self, redis: Any, store: ResultStore, ttl: int, pool: ThreadPoolExecutor) -> None:
        self.redis = redis
        self.store = store
        self.ttl = ttl
        self.pool = pool

    def get_many(self, cache_keys: Sequence[str]) -> dict[str, Outputs]:
        unique = list(dict.fromkeys(cache_keys))
        if not unique:
            return {}
        try:
            raw = self.redis.mget([keys.cache(k) for k in unique])
        except Exception as exc:  # redis.ConnectionError and friends
            raise StorageUnavailable(f"redis cache read: {exc}") from exc
        found = {k: _load(json.loads(v)) for k, v in zip(unique, raw, strict=True) if v}
        misses = [k for k in unique if k not in found]
        docs = list(self.pool.map(lambda k: self.store.get_json(keys.cache_object(k)), misses))
        warm = {k: _load(d) for k, d in zip(misses, docs, strict=True) if d is not None}
        if warm:
            self._set_redis(warm)
        found.update(warm)
        return found

    def put_many(self, entries: Mapping[str, Outputs]) -> None:
        """Durable copy first, then the hot copy (a hot entry always has a durable one)."""
        if not entries:
            return
        list(self.pool.map(lambda kv: self.store.put_json(keys.cache_object(kv[0]), _dump(kv[1])),
                           entries.items()))
        self._set_redis(entries)

    def _set_redis(self, entries: Mapping[str, Outputs]) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            for k, outs in entries.items():
                pipe.set(keys.cache(k), json.dumps(_dump(outs), separators=(",", ":")), ex=self.ttl)
            pipe.execute()
        except Exception as exc:
            raise StorageUnavailable(f"redis cache write: {exc}") from exc
