"""producer.lines: a line over the cap is read through in blocks and comes back as its length, never
held (measured with tracemalloc), and every byte still reaches the file's digest."""

from __future__ import annotations

import hashlib
import io
import tracemalloc

from producer.lines import LongLine, capped_lines, text_lines


def test_lines_keep_their_newlines_and_a_last_line_without_one() -> None:
    data = b"a\r\nbb\n\nccc"
    assert list(capped_lines(io.BytesIO(data).read, 10)) == [b"a\r\n", b"bb\n", b"\n", b"ccc"]
    assert list(text_lines(io.BytesIO("\ufeffé\nx".encode()).read, 10)) == ["é\n", "x"]


def test_a_long_line_is_its_length_only_and_is_never_held() -> None:
    big = b"x" * (10 * 1024 * 1024)
    data = b"first\n" + big + b"\n" + b"y" * 20 + b"\nlast-long" + b"z" * 200
    digest = hashlib.sha256()
    stream = io.BytesIO(data)
    tracemalloc.start()
    try:
        lines = list(capped_lines(stream.read, 64, digest))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert lines == [b"first\n", LongLine(len(big) + 1), b"y" * 20 + b"\n", LongLine(209)]
    assert peak < 1024 * 1024  # blocks of 64 KiB, not the 10 MiB line
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest()


def test_a_line_exactly_at_the_cap_is_kept() -> None:
    assert list(capped_lines(io.BytesIO(b"x" * 9 + b"\n").read, 10)) == [b"x" * 9 + b"\n"]
    assert list(capped_lines(io.BytesIO(b"x" * 10 + b"\n").read, 10)) == [LongLine(11)]


def test_a_manifest_line_over_the_cap_is_refused_by_its_length(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from ocrq.settings import LimitSettings
    from producer.expand import expand_entries

    (tmp_path / "a.png").write_bytes(b"x")
    long = "a" * (10 * 1024 * 1024)
    (tmp_path / "m.jsonl").write_text(json.dumps({"ref": long}) + "\n" + json.dumps({"ref": "a.png"}) + "\n")
    (tmp_path / "m.csv").write_text("ref,id\n" + long + "\na.png,7\n")
    entries = list(expand_entries([str(tmp_path / "m.jsonl"), str(tmp_path / "m.csv")],
                                  LimitSettings(allowed_roots=[tmp_path])))
    refused = [e for e in entries if e.kind == "refused"]
    assert [e.reason.split(" has ")[1] for e in refused] == ["10,485,772 bytes: more than 65,536 (not read)",
                                                             "10,485,761 bytes: more than 65,536 (not read)"]
    assert all(len(e.value) < 400 and len(e.reason) < 400 for e in refused)
    assert [(e.value, e.row) for e in entries if e.kind == "ref"] == [(str(tmp_path / "a.png"), None),
                                                                      (str(tmp_path / "a.png"), {"id": "7"})]
