"""Every Lua script ocrq runs: one file each in ``ocrq/broker/lua/`` (shipped in the wheel),
loaded here and nowhere else, each key it touches passed in ``KEYS`` (none built from ``ARGV``).

Past ``maxmemory``: at its ``maxmemory`` (policy ``noeviction``) Redis refuses every command that
may grow it, and a script's first such command: the fleet would stop mid-job, a chunk's records
half written. ocrq refuses new work before that (``redis.refuse_submit_at``: the producer's
writes are plain commands), and lets what finishes the work already accepted go on: recording an
image's outcome, feeding a submission's next shard, publishing a retry or a job's export, a
worker's claim on the messages it holds, the reaper's restore. Those scripts carry Redis 7's
``allow-oom`` flag (``PastMaxmemory``). They mostly shrink Redis (a message taken, a record
replaced by a one-letter marker) or write a few bytes. On a Redis before 7 (no script flags),
they run as plain scripts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: the folder of the scripts (package data: ``[tool.setuptools.package-data]``)
LUA_DIR = Path(__file__).with_name("lua")

ALLOW_OOM = "#!lua flags=allow-oom\n"


@functools.cache
def source(name: str) -> str:
    """The text of ``lua/{name}.lua``, read once per process."""
    return (LUA_DIR / f"{name}.lua").read_text()


def names() -> list[str]:
    """Every script there is, by name."""
    return sorted(p.stem for p in LUA_DIR.glob("*.lua"))


def plain(client: Any, name: str) -> Any:
    """Script ``name`` registered on ``client`` (redis-py's ``Script``: EVALSHA, loaded on its
    first use)."""
    return client.register_script(source(name))


#: what each server (by its connection pool) answered: one INFO per process and server
_SUPPORTED: dict[int, bool] = {}


def flags_supported(client: Any) -> bool:
    """Whether the server runs scripts with flags (Redis 7 and later)."""
    pool = id(client.connection_pool)
    if pool not in _SUPPORTED:
        version = str(client.info("server").get("redis_version", "0"))
        _SUPPORTED[pool] = int(version.split(".")[0]) >= 7
    return _SUPPORTED[pool]


def past_maxmemory(client: Any, name: str) -> str:
    """Script ``name``'s text, flagged ``allow-oom`` where the server supports it (for ``EVAL``)."""
    text = source(name)
    return ALLOW_OOM + text if flags_supported(client) else text


class PastMaxmemory:
    """Script ``name``, run past ``maxmemory`` (``allow-oom``) where the server supports it: the
    server's version is read on the first call, not at construction (no I/O then)."""

    def __init__(self, client: Any, name: str) -> None:
        self.client = client
        self.name = name
        self._script: Any = None

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = (), client: Any = None) -> Any:
        if self._script is None:
            self._script = self.client.register_script(past_maxmemory(self.client, self.name))
        return self._script(keys=list(keys), args=list(args), client=client)


def set_nx(client: Any, key: str, value: str, ttl: int) -> bool:
    """``SET key value NX EX ttl`` that also runs at ``maxmemory`` (a job's export flag)."""
    return bool(client.eval(past_maxmemory(client, "set_nx"), 1, key, value, ttl))
