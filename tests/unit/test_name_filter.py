"""producer.name_filter: shell patterns on a file's name, any case; what it refuses, and why."""

from __future__ import annotations

import pytest

from producer.name_filter import MAX_PATTERNS, NameFilter


def test_no_patterns_take_every_file() -> None:
    names = NameFilter.of(None)
    assert not names and names.takes("/data/notes.txt") and names.takes("s3://b/k/x")


def test_a_pattern_matches_the_name_of_a_path_or_key_in_any_case() -> None:
    names = NameFilter.of(["*.png", "scan_??.tif*"])
    assert names.takes("/data/a/PAGE.PNG") and names.takes("s3://bucket/deep/key/scan_01.tiff")
    assert not names.takes("/data/a.png.txt") and not names.takes("s3://bucket/png/readme")
    assert names.reason() == "its name matches none of *.png, scan_??.tif*"


@pytest.mark.parametrize(("patterns", "why"), [
    (["scans/*.png"], "matches a file's name, not its path: 'scans/*.png' (try '*.png')"),
    ([""], "1 to 128 characters"),
    (["x" * 129], "1 to 128 characters"),
    (["*"] * (MAX_PATTERNS + 1), f"at most {MAX_PATTERNS} name patterns"),
])
def test_bad_patterns_are_refused_with_why(patterns: list[str], why: str) -> None:
    with pytest.raises(ValueError) as exc:
        NameFilter.of(patterns)
    assert why in str(exc.value)
