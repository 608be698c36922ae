"""A job's progress from its counts and its progress hash (pure): per-image counts between chunk
records, img/s over the last seconds, ETA, and a bounded throughput series."""

from __future__ import annotations

import pytest

from ocrq.jobs.progress import BUCKET_S, BUCKETS, RawProgress, engines, parse, window_of
from producer.progress import rate_now, series, summarise

NOW = 1_000_000.0  # a window boundary (BUCKET_S divides it)


def _counts(total: int, done: int = 0, failed: int = 0, cached: int = 0) -> dict[str, int]:
    return {"queued": total - done - failed, "running": 0, "retrying": 0, "done": done, "failed": failed,
            "total": total, "cached": cached}


def test_finished_moves_image_by_image_ahead_of_the_chunk_records() -> None:
    # 64 images recorded, 10 more out of the engine whose chunk is not stored yet
    raw = RawProgress(engine=74, windows={window_of(NOW - 1): 74})
    p = summarise("j", _counts(1000, done=64), raw, created=NOW - 20, engine_recorded=64, now=NOW)
    assert p.finished == 74 and p.final == 64 and not p.complete
    # never past the total, and a finished job is its total whatever the counter says
    assert summarise("j", _counts(70, done=64), raw, NOW - 20, 64, now=NOW).finished == 70
    assert summarise("j", _counts(70, done=69, failed=1), raw, NOW - 20, 0, now=NOW).finished == 70


def test_rate_and_eta_come_from_the_last_seconds() -> None:
    w = window_of(NOW)
    # 30 images in each of the two windows before this one, 6 so far in this one (1 s into it)
    windows = {w - 2: 30, w - 1: 30, w: 6, w - 30: 500}
    rate = rate_now(windows, NOW + 1, since=NOW - 600)
    assert rate == pytest.approx(66 / (2 * BUCKET_S + 1))
    raw = RawProgress(engine=0, windows=windows)
    p = summarise("j", _counts(1000, done=340), raw, created=NOW - 600, engine_recorded=0, now=NOW + 1)
    assert p.eta_s == pytest.approx(660 / rate)
    # a young job: the rate is over its own life, not over a window it did not exist in
    assert rate_now({w: 6}, NOW + 2, since=NOW) == pytest.approx(3.0)
    # no images lately: no rate, no ETA (not "infinity")
    idle = summarise("j", _counts(10, done=5), RawProgress(0, {w - 40: 5}), NOW - 600, 0, now=NOW)
    assert idle.img_per_s == 0 and idle.eta_s is None
    done = summarise("j", _counts(10, done=10), RawProgress(0, {}), NOW - 20, 0, last_done=NOW - 10, now=NOW)
    assert done.eta_s == 0 and done.elapsed_s == 10 and done.avg_img_per_s == 1.0


def test_the_series_is_bounded_and_fills_gaps() -> None:
    w = window_of(NOW)
    windows = {w - BUCKETS - 5: 99, w - 3: 10, w - 1: 5}
    out = series(windows, NOW)
    assert out == [((w - 3) * BUCKET_S, 2.0), ((w - 2) * BUCKET_S, 0.0), ((w - 1) * BUCKET_S, 1.0)]
    assert len(series({w - i: 1 for i in range(3 * BUCKETS)}, NOW)) == BUCKETS


def test_the_hash_parses_and_the_meta_names_the_engines() -> None:
    raw = parse({b"engine": b"12", b"t5": b"3", b"t6": b"4", b"junk": b"x", b"tbad": b"1"})
    assert raw == RawProgress(12, {5: 3, 6: 4})
    assert engines({"task": "text", "engine:rapidocr": "cpu", "engine:vllm": "gpu"}) == {"rapidocr": "cpu",
                                                                                        "vllm": "gpu"}
