"""Lua scripts that finish accepted work, allowed past the broker's ``maxmemory``.

At its ``maxmemory`` (policy ``noeviction``) Redis refuses every command that may grow it, and
a script's first such command: the fleet would stop mid-job, a chunk's records half written.
ocrq refuses new work before that (``redis.refuse_submit_at``: the producer's writes are plain
commands), and lets what finishes the work already accepted go on: recording an image's outcome,
feeding a submission's next shard, publishing a retry or a job's export, a worker's claim on the
messages it holds, the reaper's restore. Those scripts carry Redis 7's ``allow-oom`` flag. They
mostly shrink Redis (a message taken, a record replaced by a one-letter marker) or write a few
bytes. On a Redis before 7 (no script flags), they run as plain scripts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ALLOW_OOM = "#!lua flags=allow-oom\n"


#: what each server (by its connection pool) answered: one INFO per process and server
_SUPPORTED: dict[int, bool] = {}


def flags_supported(client: Any) -> bool:
    """Whether the server runs scripts with flags (Redis 7 and later)."""
    pool = id(client.connection_pool)
    if pool not in _SUPPORTED:
        version = str(client.info("server").get("redis_version", "0"))
        _SUPPORTED[pool] = int(version.split(".")[0]) >= 7
    return _SUPPORTED[pool]


def body(client: Any, text: str) -> str:
    """``text`` flagged ``allow-oom`` where the server supports it."""
    return ALLOW_OOM + text if flags_supported(client) else text


class PastMaxmemory:
    """A script that runs past ``maxmemory`` (``allow-oom``) where the server supports it: the
    server's version is read on the first call, not at construction (no I/O then)."""

    def __init__(self, client: Any, body: str) -> None:
        self.client = client
        self.body = body
        self._script: Any = None

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = (), client: Any = None) -> Any:
        if self._script is None:
            self._script = self.client.register_script(body(self.client, self.body))
        return self._script(keys=list(keys), args=list(args), client=client)


# KEYS[1]: a flag key. ARGV: value, ttl seconds. SET NX EX past maxmemory; 1 if it was set.
_SET_NX = "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) and 1 or 0"


def set_nx(client: Any, key: str, value: str, ttl: int) -> bool:
    """``SET key value NX EX ttl`` that also runs at ``maxmemory`` (a job's export flag)."""
    return bool(client.eval(body(client, _SET_NX), 1, key, value, ttl))
