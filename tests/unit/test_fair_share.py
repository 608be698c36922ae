"""worker.prefetch.fair_share: several workers on one queue reserve equal shares of the work
there is, and a lone worker keeps the governor's whole window."""

from __future__ import annotations

from worker.prefetch import fair_share


def test_a_lone_worker_keeps_its_window() -> None:
    assert fair_share(26, unacked=0, ready=0, consumers=1) == 26
    assert fair_share(26, unacked=3, ready=1, consumers=0) == 26  # not registered yet


def test_an_idle_fleet_takes_a_fresh_job_in_equal_parts() -> None:
    # two idle GPU workers that would each reserve 32 chunks: 16 each when a job lands
    assert fair_share(32, unacked=0, ready=0, consumers=2) == 16
    # a second later both hold 16 and 18 wait: each may grow to half of the 50, so the job is
    # split 25/25 (not 20/30 to the worker whose first batch happened to end first)
    assert fair_share(32, unacked=32, ready=18, consumers=2) == 25


def test_a_deep_queue_leaves_the_window_as_it_is() -> None:
    assert fair_share(26, unacked=52, ready=1000, consumers=2) == 26
    assert fair_share(4, unacked=0, ready=50, consumers=8) == 4


def test_the_last_chunks_wait_for_room() -> None:
    # 25 held by two workers, 5 left in the queue: each takes up to 15 of the 30; one that already
    # holds its 15 waits, the other (10 held) may take 5
    assert fair_share(26, unacked=25, ready=5, consumers=2) == 15
    assert fair_share(3, unacked=0, ready=0, consumers=4) == 1  # never zero: a worker always takes work
