"""ocrq.messages.read_chunk: a worker reads every broker message as a stranger's. What ocrq's
producer writes reads back unchanged; anything else is refused per image (typed, recorded) or,
where nothing can be recorded, dropped."""

from __future__ import annotations

from typing import Any

import pytest

from ocrq import keys
from ocrq.errors import BadMessage, RefusedRef, TooLarge
from ocrq.messages import Chunk, Item, UnreadableMessage, read_chunk, read_job_name
from ocrq.refs import MAX_REF_CHARS

CAP = 1024 * 1024


def _id(ref: str, job: str = "j") -> str:
    return keys.image_id(job, ref)


def _message(**over: Any) -> dict[str, Any]:
    items = [Item(id=_id("/in/a.png"), ref="/in/a.png"),
             Item(id=_id("/in/b.png"), ref="/in/b.png", attempt=3, row={"id": 7}, task="parse", params={"k": 1})]
    return {**Chunk(job="j", task="text", params={"lang": "en"}, items=items, priority=2).to_message(), **over}


def test_what_the_producer_writes_reads_back_unchanged() -> None:
    message = _message()
    read = read_chunk(message, CAP)
    assert read.refused == {} and read.dropped == 0
    assert read.chunk.to_message() == message
    tenant = read_chunk({**message, "job": "acme~invoices-2026"}, CAP)
    assert tenant.chunk.job == "acme~invoices-2026"


@pytest.mark.parametrize("job", ["../../../../../../tmp/x", "a/b", "acme~../x", "", None, 7, ["j"], "x" * 200,
                                 "Acme~j", "j\n", ".hidden"])
def test_a_job_name_ocrq_does_not_write_makes_the_message_unreadable(job: Any) -> None:
    with pytest.raises(UnreadableMessage) as info:
        read_chunk(_message(job=job), CAP)
    assert len(str(info.value)) < 200  # (what the worker logs: cut)
    with pytest.raises(UnreadableMessage):
        read_job_name(job)


@pytest.mark.parametrize("message", [None, [], "x", {"job": "j"}, {"job": "j", "items": {"a": 1}}])
def test_a_message_without_items_to_record_is_unreadable(message: Any) -> None:
    with pytest.raises(UnreadableMessage):
        read_chunk(message, CAP)


def test_items_without_an_id_ocrq_makes_are_dropped_and_the_rest_run() -> None:
    good = {"id": _id("/in/a.png"), "ref": "/in/a.png"}
    items = [good, {"id": "../../x", "ref": "/in/b.png"}, {"id": "A" * 32, "ref": "/in/c.png"}, {"ref": "/in/d.png"},
             "not an item", dict(good)]
    read = read_chunk({"job": "j", "items": items}, CAP)
    assert [it.id for it in read.chunk.items] == [good["id"]] and read.dropped == 5 and read.refused == {}


@pytest.mark.parametrize(("field", "value", "error", "says"), [
    ("task", "rm -rf", BadMessage, "unknown task"),
    ("task", 3, BadMessage, "unknown task"),
    ("params", "x", BadMessage, "JSON object"),
    ("params", {"blob": "x" * (CAP // 4)}, TooLarge, "quarter"),
    ("priority", 99, BadMessage, "0 to 9"),
    ("priority", "1", BadMessage, "0 to 9"),
])
def test_a_bad_chunk_field_refuses_every_image(field: str, value: Any, error: type, says: str) -> None:
    read = read_chunk(_message(**{field: value}), CAP)
    assert len(read.refused) == 2 and all(type(e) is error and says in str(e) for e in read.refused.values())
    # nothing of the bad field goes further (records, the failed registry's mirror)
    assert read.chunk.task in ("text",) and read.chunk.params == {} and read.chunk.priority in range(10)
    assert all(it.params is None and it.task is None and it.row is None for it in read.chunk.items)


def test_an_oversized_message_refuses_its_images_too_large() -> None:
    message = _message(params={"blob": "y" * 1000})
    read = read_chunk(message, 900)
    assert {type(e) for e in read.refused.values()} == {TooLarge}
    assert "max_message_bytes" in str(next(iter(read.refused.values())))


@pytest.mark.parametrize(("over", "error", "says"), [
    ({"ref": 12}, BadMessage, "ref must be text"),
    ({"attempt": 0}, BadMessage, "attempt"),
    ({"attempt": True}, BadMessage, "attempt"),
    ({"attempt": 10**9}, BadMessage, "attempt"),
    ({"row": ["x"]}, BadMessage, "row"),
    ({"row": {"blob": "z" * 20_000}}, BadMessage, "row of more"),
    ({"task": "nope"}, BadMessage, "unknown task"),
    ({"params": {"blob": "p" * (CAP // 4)}}, TooLarge, "quarter"),
])
def test_a_bad_item_field_refuses_that_image_only(over: dict[str, Any], error: type, says: str) -> None:
    message = _message()
    message["items"][1].update(over)
    read = read_chunk(message, CAP)
    (why,) = read.refused.values()
    assert type(why) is error and says in str(why)
    assert list(read.refused) == [message["items"][1]["id"]] and len(read.chunk.items) == 2
    assert read.chunk.items[0].model_dump() == Item(id=_id("/in/a.png"), ref="/in/a.png").model_dump()


def test_an_over_long_ref_is_refused_and_shown_cut() -> None:
    ref = "/in/" + "a" * (10 * 1024 * 1024) + "?sig=secret"
    read = read_chunk({"job": "j", "items": [{"id": _id("x"), "ref": ref}]}, 64 * 1024 * 1024)
    (why,) = read.refused.values()
    assert isinstance(why, RefusedRef) and f"more than {MAX_REF_CHARS}" in str(why)
    assert len(read.chunk.items[0].ref) < 400 and "secret" not in read.chunk.items[0].ref


def test_a_bad_outage_start_is_dropped_not_refused() -> None:
    for value in ("soon", float("nan"), -1, [1]):
        read = read_chunk(_message(outage_since=value), CAP)
        assert read.refused == {} and read.chunk.outage_since is None
