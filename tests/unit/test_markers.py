"""ocrq.markers: the per-image marker, read one way everywhere, and spelled the same in the Lua
that writes it (ocrq/broker/lua/index_record.lua's ``marks``)."""

from __future__ import annotations

import re

from ocrq import markers
from ocrq.broker import scripts
from ocrq.results import ImageStatus


def test_each_marker_says_its_status_and_names_its_part() -> None:
    assert markers.queued(3) == b"q3" and markers.is_unpublished(b"q3") and markers.is_queued(b"q3")
    assert markers.is_queued(b"p") and not markers.is_unpublished(b"p")
    assert [markers.status(v) for v in (b"q3", b"p", b"d12", b"c7", b"f1", b"x")] == [
        ImageStatus.queued, ImageStatus.queued, ImageStatus.done, ImageStatus.done, ImageStatus.failed,
        ImageStatus.cancelled]
    assert [markers.part_number(v) for v in (b"d12", b"c7", b"f1", b"d")] == [12, 7, 1, None]
    assert all(markers.is_final(v) for v in (b"d12", b"c", b"f3")) and not markers.is_final(b"x")
    record = b'{"id": "a", "status": "running"}'
    assert markers.is_record(record) and markers.status(record) is None and not markers.is_final(record)
    assert not any(f(None) for f in (markers.is_record, markers.is_queued, markers.is_final, markers.is_unpublished))
    assert markers.status(None) is None and markers.status(b"") is None


def test_the_record_script_reads_markers_as_this_module_does() -> None:
    table = re.search(r"local marks = \{([^}]*)\}", scripts.source("index_record"))
    assert table is not None
    lua = {k.encode(): ImageStatus(v) for k, v in re.findall(r"(\w) = '(\w+)'", table.group(1))}
    assert lua == markers.STATUS
