"""What a worker kill costs the images it held: just before each SIGKILL the suite reads the
victim's claim (``ocrq:held:{node}``, refreshed each second) and the chunks those delivery tags
name in kombu's ``unacked`` hash; after the run, each of those images that finished after the kill
was finished by a redelivery, and ``record.updated − kill time`` is the delay the kill added to it
(an upper bound: it includes the redelivered chunk's own run and any queue wait)."""

from __future__ import annotations

import base64
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from ocrq import keys

#: the issue's bound on the delay a kill adds (p99), production timings
KILL_DELAY_P99_MAX_S = 120.0


@dataclass
class KillLog:
    #: (kill time, epoch s; image ids the victim held)
    kills: list[tuple[float, set[str]]] = field(default_factory=list)

    def snapshot(self, client: Any, node: str) -> None:
        """Call right before the kill; a Redis that is down at that moment gives an empty set."""
        held: set[str] = set()
        try:
            tags = sorted(client.smembers(keys.held_tags(node)))
            for entry in client.hmget(keys.CELERY_UNACKED, tags) if tags else []:
                if entry is not None:
                    held |= _image_ids(json.loads(entry)[0])
        except Exception:  # Redis restarting (the combined scenario): nothing known for this kill
            pass
        self.kills.append((time.time(), held))


def _image_ids(message: dict[str, Any]) -> set[str]:
    body = json.loads(base64.b64decode(message["body"]))  # Celery protocol 2: [args, kwargs, embed]
    args = body[0]
    chunk = args[0] if args and isinstance(args[0], dict) else {}
    return {str(item["id"]) for item in chunk.get("items", []) if isinstance(item, dict) and "id" in item}


@dataclass
class KillDelays:
    images: int
    p50: float
    p99: float
    max: float

    def note(self) -> str:
        return (f"kill→redelivered done: p50 {self.p50:.0f} s, p99 {self.p99:.0f} s, max {self.max:.0f} s"
                f" over {self.images} held images")


def kill_delays(log: KillLog, records: dict[str, Any]) -> KillDelays | None:
    """Per held image, the delay from the kill to its final record (only images that finished
    after the kill: those the kill actually held up). None when no kill held anything."""
    delays: list[float] = []
    for at, ids in log.kills:
        for image_id in ids:
            rec = records.get(image_id)
            updated = getattr(rec, "updated", None)
            if updated is not None and updated > at:
                delays.append(updated - at)
    if not delays:
        return None
    delays.sort()
    return KillDelays(len(delays), _pct(delays, 50), _pct(delays, 99), delays[-1])


def _pct(sorted_values: list[float], p: float) -> float:
    k = max(0, math.ceil(p / 100 * len(sorted_values)) - 1)
    return sorted_values[k]
