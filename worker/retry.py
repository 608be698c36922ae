"""The retry policy, kept apart from one attempt (worker.tasks.process_chunk).

An image whose attempt raised a Retryable error gets another attempt while it has budget left;
once the budget is spent it fails for good with ``RetriesExhausted`` (permanent), whose message
names the last real cause. The delay grows exponentially with full jitter so a burst of OOMs or
a storage outage does not come back as a synchronized thundering herd.
"""

from __future__ import annotations

import random

from ocrq.errors import OcrqError, RetriesExhausted


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
