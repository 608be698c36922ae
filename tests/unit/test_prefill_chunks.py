"""Chunking a batch's prefill by padded prompt tokens (pure planning, no model)."""

from __future__ import annotations

from worker.engines.transformers.prefill import prefill_chunks


def test_chunks_cover_rows_in_order_within_budget() -> None:
    lengths = [800, 820, 3100, 3120, 400, 810, 805]
    chunks = prefill_chunks(lengths, 4000)
    assert [i for a, b in chunks for i in range(a, b)] == list(range(len(lengths)))
    for a, b in chunks:
        assert (b - a) * max(lengths[a:b]) <= 4000 or b - a == 1
    assert chunks == [(0, 2), (2, 3), (3, 4), (4, 7)]


def test_one_chunk_when_it_fits_and_one_row_each_when_nothing_does() -> None:
    assert prefill_chunks([100, 200, 300], 16384) == [(0, 3)]
    assert prefill_chunks([100, 200, 300], 1) == [(0, 1), (1, 2), (2, 3)]
    assert prefill_chunks([], 100) == []
