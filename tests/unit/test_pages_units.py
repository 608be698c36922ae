"""The jobs pages' pure parts: how numbers are written, the progress bar's segments, the plots'
series, where sign-in may send a browser, and the CSRF token."""

from __future__ import annotations

import pytest

from api import pages_format as fmt
from api.pages_data import MAX_POINTS, progress_points, series
from api.pages_signin import csrf_token, local_path


@pytest.mark.parametrize(("seconds", "text"), [(None, "–"), (0, "0 s"), (59.4, "59 s"), (61, "1 min 01 s"),
                                               (3600 * 2 + 300, "2 h 05 min"), (3600 * 24 * 3 + 3600 * 4, "3 d 4 h")])
def test_durations(seconds, text):
    assert fmt.duration(seconds) == text


@pytest.mark.parametrize(("n", "text"), [(None, "–"), (512, "512 B"), (1536, "1.5 KiB"), (24 * 2**30, "24.0 GiB")])
def test_sizes(n, text):
    assert fmt.size(n) == text


@pytest.mark.parametrize(("usd", "text"), [(None, "–"), (0, "$0"), (0.00042, "$0.0004"), (12.3, "$12.30"),
                                           (1234.5, "$1,234")])
def test_dollars(usd, text):
    assert fmt.usd(usd) == text


def test_the_progress_bar_lays_its_segments_end_to_end():
    # Given 200 images: 100 done (20 of them from the cache), 30 failed, 10 cancelled, 60 not yet
    p = fmt.progress({"total": 200, "done": 100, "cached": 20, "failed": 30, "cancelled": 10})
    seg = {s["name"]: s for s in p["segments"]}
    # Then done (engine) 40 %, cached 10 %, failed 15 %, cancelled 5 %, each starting where the last ended
    assert [(s["name"], s["x"], s["width"]) for s in p["segments"]] == [
        ("fresh", 0.0, 40.0), ("cached", 40.0, 10.0), ("failed", 50.0, 15.0), ("cancelled", 65.0, 5.0)]
    assert seg["failed"]["class"] == "seg-failed"
    assert (p["final"], p["left"], p["label"]) == (140, 60, "140 / 200")
    assert p["text"] == ("140 of 200 images final: 100 done (20 from the cache), 30 failed, 10 cancelled, "
                         "60 not yet")
    empty = fmt.progress({"total": 0})
    assert all(s["width"] == 0 for s in empty["segments"]) and empty["label"] == "0 / 0"


def test_a_row_shows_eta_only_while_the_job_moves():
    view = {"id": "j", "state": "running", "counts": {"total": 10, "done": 5}, "images_per_second": 2.5,
            "eta_seconds": 2.0, "cost": {"usd": 0.001}, "created_at": 1000, "task": "text"}
    assert fmt.row(view, now=1090)["eta"] == "2 s" and fmt.row(view, now=1090)["age"] == "1 min 30 s ago"
    assert fmt.row({**view, "state": "succeeded"}, now=1090)["eta"] == "–"


def test_progress_points_of_what_the_index_keeps():
    # a job not started: its creation only, and now while it waits
    assert progress_points(None, "j", 100.0, 0.0, 0, True, 130.0) == [(100.0, 0), (130.0, 0)]  # type: ignore[arg-type]
    # running: created, the last image done, now
    assert progress_points(None, "j", 100.0, 120.0, 50, True, 130.0) == [  # type: ignore[arg-type]
        (100.0, 0), (120.0, 50), (130.0, 50)]
    # finished: created and the last image done
    assert progress_points(None, "j", 100.0, 120.0, 50, False, 500.0) == [(100.0, 0), (120.0, 50)]  # type: ignore


def test_series_are_seconds_since_the_first_point_and_rates_between_points():
    s = series([(1000.0, 0), (1010.0, 50), (1020.0, 50), (1030.0, 80)])
    assert s["start"] == 1000.0
    assert s["cumulative"] == [[0.0, 0], [10.0, 50], [20.0, 50], [30.0, 80]]
    assert s["rate"] == [[0.0, 10.0, 5.0], [10.0, 20.0, 0.0], [20.0, 30.0, 3.0]]
    # a long series is thinned evenly to MAX_POINTS, keeping both ends
    long = series([(float(t), t * 2) for t in range(10_000)])
    assert len(long["cumulative"]) == MAX_POINTS
    assert long["cumulative"][0] == [0.0, 0] and long["cumulative"][-1] == [9999.0, 19998]
    assert series([(5.0, 0)]) == {"start": 5.0, "cumulative": [[0.0, 0]], "rate": []}


@pytest.mark.parametrize(("target", "safe"), [
    ("/jobs/a?notice=cancelled", "/jobs/a?notice=cancelled"), ("/fleet", "/fleet"), (None, "/"), ("", "/"),
    ("//evil.example", "/"), ("/\\evil.example", "/"), ("https://evil.example/", "/"), ("javascript:alert(1)", "/"),
    ("/\r\nSet-Cookie: x", "/"), ("fleet", "/")])
def test_sign_in_only_goes_to_a_path_of_this_site(target, safe):
    assert local_path(target) == safe


def test_the_csrf_token_belongs_to_its_sign_in_and_hides_it():
    a, b = csrf_token("ocrq_aaaa"), csrf_token("ocrq_bbbb")
    assert a == csrf_token("ocrq_aaaa") and a != b and len(a) == 64 and "aaaa" not in a
