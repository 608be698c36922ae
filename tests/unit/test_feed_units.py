"""Pure parts of the submission feed: a submission's identity, its shards' lines, and chunks
grouped by count and by message bytes."""

from __future__ import annotations

import json

from ocrq.jobs.feed import read_entries, shard_bytes, submission_id
from ocrq.messages import Chunk, Item, chunk_groups, message_bytes


def test_a_submission_is_its_task_params_and_refs_in_order() -> None:
    lines = ['["/a.png", null]\n', '["/b.png", null]\n']
    same = submission_id("text", {"x": 1}, lines)
    assert same == submission_id("text", {"x": 1}, list(lines))
    assert same != submission_id("text", {"x": 2}, lines)
    assert same != submission_id("parse", {"x": 1}, lines)
    assert same != submission_id("text", {"x": 1}, lines[::-1])


def test_shard_lines_round_trip() -> None:
    lines = [("id1", "/a.png", None), ("id2", "s3://b/k.png", {"id": 7, "meta": "é"})]
    raw = shard_bytes(lines)
    assert [tuple(json.loads(line)) for line in raw.splitlines()] == lines


def test_entries_come_in_windows() -> None:
    entries = iter([(f"/{i}", None) for i in range(10)])
    assert [len(w) for w in read_entries(entries, size=4)] == [4, 4, 2]


def test_chunks_keep_their_count_and_their_message_under_the_cap() -> None:
    small = [Item(id=f"i{n}", ref=f"/r{n}") for n in range(10)]
    assert [len(g) for g in chunk_groups(small, 4, 1 << 20)] == [4, 4, 2]
    big = [Item(id=f"i{n}", ref=f"/r{n}", row={"blob": "x" * 3000}) for n in range(10)]
    groups = chunk_groups(big, 64, 10_000)
    assert sum(len(g) for g in groups) == 10 and len(groups) > 1
    for g in groups:
        assert message_bytes(Chunk(job="j", items=g).to_message()) <= 10_000
