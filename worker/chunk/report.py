"""What one attempt at a chunk reports: images done, cached, failed (named), skipped, and those
handed back to the broker with their countdown; ``summary`` is the task result Flower shows. A
value: the store step (or a whole-chunk failure) builds it once, later changes are copies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ocrq.errors import OcrqError
from ocrq.messages import Item
from ocrq.redact import redact_url

#: failed images named one by one in a chunk's result (Flower's task page); the rest are counted
_NAMED_FAILURES = 8

#: (ref, error type, message) of an image that failed for good
Failure = tuple[str, str, str]


def failure(item: Item, err: OcrqError) -> Failure:
    """How a report names an image that failed for good (its ref redacted)."""
    return redact_url(item.ref), type(err).__name__, err.to_dict()["message"]


@dataclass(frozen=True)
class ChunkReport:
    done: int = 0
    cached: int = 0
    failed: int = 0
    #: images handed back to the broker, each with its next attempt
    retry: tuple[Item, ...] = ()
    countdown: float = 0.0
    #: the retry message's ``Chunk.outage_since`` (None: not an outage hand-back)
    outage_since: float | None = None
    #: each image that failed for good in this attempt
    failures: tuple[Failure, ...] = ()
    #: images not run: done already, or their job archived (a late redelivery)
    skipped: int = 0

    def summary(self) -> dict[str, Any]:
        """The chunk task's result, as Flower's task list and task page show it: ``outcome``
        first, so a chunk with failed images reads as such although its state is SUCCESS."""
        total = self.done + self.failed + len(self.retry)
        by_type: dict[str, int] = {}
        for _, kind, _ in self.failures:
            by_type[kind] = by_type.get(kind, 0) + 1
        if self.failed:
            outcome = f"FAILED {self.failed}/{total}: " + ", ".join(f"{k}×{n}" for k, n in sorted(by_type.items()))
        elif self.retry:
            outcome = f"RETRY {len(self.retry)}/{total}"
        else:
            outcome = f"ok {self.done}/{total}"
        if not total and self.skipped:
            outcome = f"skipped {self.skipped}: done already"
        out: dict[str, Any] = {"outcome": outcome, "done": self.done, "cached": self.cached,
                               "failed": self.failed, "retry": len(self.retry)}
        if self.skipped:
            out["skipped"] = self.skipped
        if self.failures:
            out["errors"] = [{"ref": ref, "type": kind, "message": msg[:300]}
                             for ref, kind, msg in self.failures[:_NAMED_FAILURES]]
        return out
