"""The retry policy, kept apart from one attempt (worker.tasks.process_chunk, worker.chunk).

An image whose attempt raised a Retryable error gets another attempt while it has budget left;
once the budget is spent it fails for good with ``RetriesExhausted`` (permanent), whose message
names the last real cause. The delay grows exponentially with full jitter so a burst of OOMs or
a storage outage does not come back as a synchronized thundering herd.

An outage of ocrq's own store or Redis (a retryable error that is not the image's) spends no
attempt: the chunk (or the job's export) waits it out for up to ``queue.outage_retry_s``
(``outage_wait``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from ocrq.errors import OcrqError, RetriesExhausted
from ocrq.messages import Item
from ocrq.settings import QueueSettings


def should_retry(error: OcrqError, attempt: int, max_attempts: int) -> bool:
    return error.retryable and attempt < max_attempts


def final_error(error: OcrqError, attempt: int, max_attempts: int) -> OcrqError | None:
    """None when the image gets another attempt; else the error it is recorded with: the error
    itself when permanent, ``RetriesExhausted`` when a retryable error used the last attempt."""
    if should_retry(error, attempt, max_attempts):
        return None
    return RetriesExhausted.after(attempt, error) if error.retryable else error


def backoff(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Seconds before attempt ``attempt + 1``: uniform in [0.5, 1] × min(cap, base·2^(attempt−1))."""
    ceiling = min(cap, base * (2 ** max(0, attempt - 1)))
    return ceiling * (0.5 + 0.5 * (rng or random).random())


def outage_wait(q: QueueSettings, err: OcrqError, since: float | None) -> float | None:
    """Seconds to wait before trying again through an outage of ocrq's own store or Redis (a
    retryable error that is not the image's), or None once it lasted ``queue.outage_retry_s``.
    The wait grows with the outage, never below ``backoff_base`` (no spin) nor above
    ``backoff_max``."""
    lasted = 0.0 if since is None else time.time() - since
    if not err.retryable or lasted >= q.outage_retry_s:
        return None
    return backoff(1, max(q.backoff_base, min(q.backoff_max, lasted)), q.backoff_max)


def countdown(q: QueueSettings, retry: Sequence[Item]) -> float:
    """Seconds before a chunk's retry message runs: the backoff of its least-tried image."""
    return backoff(min(i.attempt for i in retry) - 1, q.backoff_base, q.backoff_max)
