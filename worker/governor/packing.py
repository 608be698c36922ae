"""Which pending images make a micro-batch, given the token room the memory budget leaves (pure).

The governor (``worker.governor.governor``) decides the room and the count cap; this module only packs.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.memory.costs import ImageCost


def batch_tokens(costs: Sequence[ImageCost], padded: bool) -> int:
    """Tokens a batch holds on the device: padded engines (HF generate) pad to the longest."""
    if not costs:
        return 0
    if padded:
        return len(costs) * max(c.total_tokens for c in costs)
    return sum(c.total_tokens for c in costs)


def pack(
    pending: Sequence[ImageCost],
    room: float,
    cap_n: int,
    *,
    padded: bool,
    skips: Sequence[int] | None = None,
    max_skips: int = 4,
    lookahead: int = 513,
) -> list[int]:
    """Indices (ascending) of the pending images, oldest first, whose batch tokens fit ``room``,
    at most ``cap_n`` of them, looking at most ``lookahead`` images ahead.

    Packing by cost may pass over a big image to fill with small ones, never forever: an image
    skipped ``max_skips`` times goes first, otherwise the oldest does (the first one always
    goes, even alone over the room: the engine loop then downscales or fails it)."""
    n = len(pending)
    if n == 0:
        return []
    # images skipped too often go first, then the oldest, then the rest in arrival order
    pinned = [i for i in range(n) if skips is not None and skips[i] >= max_skips]
    if 0 not in pinned:
        pinned.append(0)
    pinned_set = set(pinned)
    rest = [i for i in range(1, min(n, lookahead + len(pinned))) if i not in pinned_set]
    if padded:
        # a padded engine pays n × the longest row: fill with the images closest in size to the
        # pinned ones, so a batch is homogeneous (bigger images wait for their own batch, never
        # longer than max_skips batches)
        anchor = max(pending[i].total_tokens for i in pinned)
        rest.sort(key=lambda i: (abs(pending[i].total_tokens - anchor), i))
    chosen: list[int] = []
    total = 0
    longest = 0
    for i in pinned + rest:
        if len(chosen) >= cap_n:
            break
        t = pending[i].total_tokens
        need = (len(chosen) + 1) * max(longest, t) if padded else total + t
        if not chosen or need <= room:
            chosen.append(i)
            total += t
            longest = max(longest, t)
    return sorted(chosen)
