"""``worker.engines.vllm.vision.groups``: pure (the tower itself is tested in the vllm tier)."""

from __future__ import annotations

import pytest

from worker.engines.vllm.vision import ENV, group_patches, groups


def test_pages_group_in_order_up_to_the_limit_and_a_larger_page_runs_alone() -> None:
    assert groups([5, 5, 20, 3, 3, 3], 10) == [range(0, 2), range(2, 3), range(3, 6)]
    assert groups([12288, 3072, 3072, 3072, 3072, 3072, 925], 16384) == [range(0, 2), range(2, 7)]
    assert groups([], 10) == []
    assert groups([7], 1) == [range(0, 1)]


def test_every_page_is_in_exactly_one_group() -> None:
    lengths = [925, 3072, 12288, 3072, 925, 925, 12288, 20000, 3072]
    got = [i for g in groups(lengths, 16384) for i in g]
    assert got == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 16384 or len(g) == 1 for g in groups(lengths, 16384))


@pytest.mark.parametrize(("value", "expected"), [("", 0), ("0", 0), ("16384", 16384), ("-3", 0), ("x", 0)])
def test_the_limit_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str, expected: int) -> None:
    monkeypatch.setenv(ENV, value)
    assert group_patches() == expected
