"""worker.gcwatch: full collections are counted and timed; freeze takes what exists out of reach."""

from __future__ import annotations

import gc

from worker import gcwatch


def test_full_collections_are_counted_and_timed() -> None:
    gcwatch.install()
    gcwatch.install()  # idempotent: one callback
    before = gcwatch.snapshot()
    gc.collect()
    after = gcwatch.snapshot()
    assert gc.callbacks.count(gcwatch._callback) == 1
    assert after["full"] == before["full"] + 1
    assert after["full_s"] >= before["full_s"]


def test_freeze_moves_live_objects_out_of_the_collectors_reach() -> None:
    keep = [[i] for i in range(1000)]  # tracked containers alive now
    try:
        frozen = gcwatch.freeze()
        assert frozen >= len(keep)
        # frozen objects can still die (a thread left by an earlier test frees one), none join
        assert len(keep) <= gc.get_freeze_count() <= frozen
        assert gcwatch.snapshot()["frozen"] == frozen
    finally:
        gc.unfreeze()
