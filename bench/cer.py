"""Character error rate: Levenshtein distance over characters / reference length.

The DP is vectorised per row with numpy: substitutions and deletions come from the previous row
in one step; insertions (a left-to-right dependency) reduce to a running minimum, because
``D[j] = min_k (A[k] + j - k) = j + cummin(A - k)``. A 4,000×4,000 page takes ~0.1 s.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Collapse every whitespace run (newlines included) to one space and trim the ends, so
    line breaks versus spaces between boxes do not count as errors."""
    return _SPACE.sub(" ", text).strip()


def normalise_loose(text: str) -> str:
    """Case-folded, all whitespace removed: for sources whose labels are upper-case (SROIE) or
    have their spaces removed (WildReceipt)."""
    return _SPACE.sub("", text).casefold()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute; each costs 1) between two strings."""
    if a == b:
        return 0
    if not a or not b:
        return max(len(a), len(b))
    if len(a) < len(b):  # iterate over the longer string: fewer, wider numpy steps
        a, b = b, a
    codes_b = np.fromiter((ord(c) for c in b), dtype=np.int64, count=len(b))
    idx = np.arange(len(b) + 1, dtype=np.int64)
    prev = idx.copy()
    for i, ch in enumerate(a, start=1):
        sub = prev[:-1] + (codes_b != ord(ch))
        best = np.empty_like(prev)
        best[0] = i
        best[1:] = np.minimum(prev[1:] + 1, sub)
        # insertions: best[j] = min over k <= j of best[k] + (j - k)
        prev = np.minimum.accumulate(best - idx) + idx
    return int(prev[-1])


def cer(reference: str, hypothesis: str) -> float:
    """Edit distance / len(reference); 0.0 for two empty strings, 1.0 for an empty reference
    with a non-empty hypothesis."""
    if not reference:
        return 0.0 if not hypothesis else 1.0
    return levenshtein(reference, hypothesis) / len(reference)


def bag_error(reference: str, hypothesis: str) -> float:
    """Order-insensitive error: characters missing from or extra in the hypothesis (multiset
    difference), over len(reference). For labels listed per box in annotation order (SROIE,
    FUNSD, ICDAR) where reading order is not part of the truth."""
    ref, hyp = Counter(reference), Counter(hypothesis)
    if not reference:
        return 0.0 if not hypothesis else 1.0
    missing = sum((ref - hyp).values())
    extra = sum((hyp - ref).values())
    return max(missing, extra) / len(reference)
