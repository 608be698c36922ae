"""Result parts (ocrq.output.parts) over a real Redis index and the SQLite store: a job read back while it
runs, through its results index once archived, and after a reprocess of the archived job."""

from __future__ import annotations

import json

import pytest

from ocrq import keys
from ocrq.jobs.feed import Feed, shard_bytes
from ocrq.jobs.index import JobIndex
from ocrq.output.export import export_job, results
from ocrq.results import ErrorInfo, ImageRecord, ImageResult, ImageStatus, OcrOutput
from ocrq.store.sqlite_store import SqliteStore

pytestmark = pytest.mark.integration


def rec(i: int, status: ImageStatus, **kw) -> ImageRecord:
    return ImageRecord(id=f"id{i}", job="j", ref=f"/r{i}", status=status, **kw)


def doc(r: ImageRecord, text: str) -> ImageResult:
    return ImageResult(record=r, outputs=[OcrOutput(text=text, engine="e", model="m")] if r.status == "done" else [])


def store_part(index: JobIndex, store: SqliteStore, docs: list[ImageResult]) -> int:
    """What a worker does with a chunk's final images: one part, then their records naming it."""
    epoch, n = index.new_part("j")
    store.put_many([(keys.result_part("j", epoch, n), b"\n".join(d.model_dump_json().encode() for d in docs))])
    index.record([d.record for d in docs], part=n)
    return n


@pytest.fixture()
def job(redis_client, tmp_path):
    index = JobIndex(redis_client, ttl=60)
    index.create("j", {"task": "text"})
    store = SqliteStore(tmp_path / "store")
    feed = Feed(redis_client, store, index, app=None, window=65536, chunk_size=4, max_message_bytes=2**20)
    sub, _ = feed.register("j", "s1", 1, "text", {}, "ocrq", None)
    assert index.record_queued("j", [f"id{i}" for i in range(7)], sub.ordinal) == [True] * 7
    store.put_many([(keys.refs_shard("j", "s1", 0), shard_bytes((f"id{i}", f"/r{i}", None) for i in range(8)))])
    feed.written("j", sub, 1)  # (id7 is in the shard without a record: listed as queued)
    return index, store


def test_a_running_job_reads_each_image_once_from_the_part_its_marker_names(job, redis_client):
    index, store = job
    first = store_part(index, store, [doc(rec(i, ImageStatus.done, pages=1), f"text id{i}") for i in range(3)])
    store_part(index, store, [doc(rec(3, ImageStatus.done, pages=1), "text id3")])
    # id4: a document as written before parts (a marker without a number names the object)
    r4 = rec(4, ImageStatus.done, pages=1)
    store.put_many([(keys.result_object("j", "id4"), doc(r4, "text id4").model_dump_json().encode())])
    index.record([r4])
    index.record([rec(5, ImageStatus.running)])
    index.record([rec(6, ImageStatus.done)], part=99)  # final, its part missing from the store
    assert redis_client.hget(keys.job_images("j"), "id0") == f"d{first}".encode()
    got = {r.record.id: r for r in results(index, store, "j", batch=2)}
    assert sorted(got) == [f"id{i}" for i in range(8)]
    assert all(got[f"id{i}"].text == f"text id{i}" for i in range(5))
    assert got["id7"].record.status is ImageStatus.queued and got["id7"].record.ref == "/r7"
    assert got["id5"].outputs == [] and got["id5"].record.status is ImageStatus.running
    assert got["id6"].outputs == [] and got["id6"].record.status is ImageStatus.done


def test_an_archived_job_reads_through_its_index_and_a_reprocess_replaces_lines(job, redis_client):
    index, store = job
    bad = ErrorInfo(type="BadImage", message="x")
    store_part(index, store, [doc(rec(i, ImageStatus.done), f"v1 id{i}") for i in range(4)]
               + [doc(rec(4, ImageStatus.failed, error=bad), "")])
    # id0 done again in a later part (a chunk run twice: a redelivery, a Redis failover): the
    # first done stands, the later part's line is never read
    store_part(index, store, [doc(rec(0, ImageStatus.done), "v2 id0")])
    store_part(index, store, [doc(rec(i, ImageStatus.done), f"v1 id{i}") for i in (5, 6)]
               + [doc(ImageRecord(id="id7", job="j", ref="/r7", status=ImageStatus.done), "v1 id7")])
    marker = export_job(index, store, "j")
    assert marker["exported"] and marker["lines"] == 8
    redis_client.set(keys.job_finishing("j"), "1")
    assert index.archive("j", index.counts("j")["total"]) and not redis_client.exists(keys.job_images("j"))
    idx = store.get_json(keys.results_index("j"))
    # in the order the walk met them; part 2 (id0's second result) holds nothing current
    assert [(name[-10:], skip) for name, skip in idx["parts"]] == [("0001.jsonl", []), ("0003.jsonl", [])]
    assert idx["submissions"] == ["s1"]

    def texts() -> dict[str, tuple[str, str]]:
        out = [(r.record.id, (r.record.status.value, r.text)) for r in results(index, store, "j", batch=2)]
        assert len(out) == len(dict(out)), "an image listed twice"
        return dict(out)

    archived = texts()
    assert archived["id0"] == ("done", "v1 id0") and archived["id4"] == ("failed", "")
    assert len(archived) == 8
    # a reprocess of the archived job's failure: reopened, it reads the index with Redis over it
    index.record([rec(4, ImageStatus.queued)], mode="reopen")
    assert texts()["id4"] == ("queued", "") and len(texts()) == 8
    store_part(index, store, [doc(rec(4, ImageStatus.done), "v2 id4")])
    assert texts()["id4"] == ("done", "v2 id4")
    assert export_job(index, store, "j")["lines"] == 8
    path = keys.export_object("j", keys.EXPORT_JSONL)
    exported = [json.loads(line) for line in store.get_many([path], raw=True)[path].splitlines()]
    assert sorted(line["id"] for line in exported) == [f"id{i}" for i in range(8)]
    assert {line["id"]: line["text"] for line in exported}["id4"] == "v2 id4"
    redis_client.set(keys.job_finishing("j"), "1")
    assert index.archive("j", index.counts("j")["total"])
    assert texts() == {**archived, "id4": ("done", "v2 id4")}


def test_records_no_shard_names_are_found_by_a_scan(job, redis_client):
    """A chunk published by something other than ocrq submit: its images have records, no shard."""
    index, store = job
    store_part(index, store, [doc(ImageRecord(id=f"x{i}", job="j", ref=f"/x{i}", status=ImageStatus.done),
                                  f"text x{i}") for i in range(3)])
    got = {r.record.id: r for r in results(index, store, "j", batch=2)}
    assert sorted(got) == [f"id{i}" for i in range(8)] + ["x0", "x1", "x2"]
    assert got["x1"].text == "text x1"


@pytest.mark.parametrize("read_before", [1, 3, 7])
def test_a_job_archived_while_it_is_read_is_read_whole(job, redis_client, read_before):
    """`submit --wait` then results: the job's export and archive may run while it is read (its
    markers and shards go): the reader goes on through the results index, each image once."""
    index, store = job
    store_part(index, store, [doc(rec(i, ImageStatus.done), f"text id{i}") for i in range(7)]
               + [doc(ImageRecord(id="id7", job="j", ref="/r7", status=ImageStatus.done), "text id7")])
    reader = results(index, store, "j", batch=2)
    got = [next(reader) for _ in range(read_before)]
    assert export_job(index, store, "j")["exported"]
    redis_client.set(keys.job_finishing("j"), "1")
    assert index.archive("j", index.counts("j")["total"])
    store.delete_many(store.list(keys.refs_prefix("j")))
    got += list(reader)
    assert sorted(r.record.id for r in got) == [f"id{i}" for i in range(8)]
    assert all(r.text == f"text {r.record.id}" for r in got)


@pytest.mark.parametrize("kind", ["sqlite", "files", "s3"])
def test_a_part_is_created_never_replaced(kind, tmp_path, request):
    """``put_many``'s ``new``: a path that exists raises NameTaken and keeps its document (S3's
    If-None-Match on moto's server, SQLite's INSERT, a hard link on disk)."""
    from ocrq.errors import NameTaken
    from ocrq.store.local_store import LocalStore
    from ocrq.store.storage import S3Store

    if kind == "s3":
        client, bucket = request.getfixturevalue("s3_bucket")
        store = S3Store(client, bucket, "p")
    else:
        store = SqliteStore(tmp_path) if kind == "sqlite" else LocalStore(tmp_path)
    path = keys.result_part("j", "e0", 1)
    store.put_many([(path, b"first\n"), ("cache/a.json", {"a": 1})], new=[path])
    with pytest.raises(NameTaken):
        store.put_many([(path, b"second\n"), ("cache/a.json", {"a": 2})], new=[path])
    assert store.get_many([path], raw=True)[path] == b"first\n"
    store.put_many([(path, b"third\n")])  # (without ``new``, a write replaces)
    assert store.get_many([path], raw=True)[path] == b"third\n"
    assert not [p for p in (tmp_path.rglob(".tmp-*") if kind == "files" else [])]


def test_a_part_number_handed_out_twice_keeps_both_chunks_documents(job, redis_client):
    """Redis sets the part counter back (a failover promoted a replica that had not yet seen the
    last HINCRBY, or a crash lost it from the AOF) while a chunk's markers survive naming that
    number: the next chunk given the same number takes the next free one instead of replacing the
    part, and every image reads back its own document."""
    from types import SimpleNamespace

    from ocrq.messages import Chunk, Item
    from worker.chunk.store import write_documents

    index, store = job

    def chunk_of(ids: range) -> tuple[Chunk, list[ImageResult]]:
        items = [Item(id=f"id{i}", ref=f"/r{i}") for i in ids]
        return (Chunk(job="j", task="text", items=items),
                [doc(rec(i, ImageStatus.done, pages=1), f"text id{i}") for i in ids])

    ctx = SimpleNamespace(index=index)
    first, docs = chunk_of(range(0, 3))
    n, _ = write_documents(ctx, first, docs, lambda writes, new: store.put_many(writes, new=new))
    index.record([d.record for d in docs], part=n)
    redis_client.hincrby(keys.job("j"), "parts", -1)  # the counter set back
    second, docs = chunk_of(range(3, 6))
    m, _ = write_documents(ctx, second, docs, lambda writes, new: store.put_many(writes, new=new))
    index.record([d.record for d in docs], part=m)
    assert m == n + 1
    got = {r.record.id: r for r in results(index, store, "j")}
    assert [got[f"id{i}"].outputs[0].text for i in range(6)] == [f"text id{i}" for i in range(6)]


def test_a_reader_following_a_job_reads_only_the_parts_of_images_it_has_not_had(job, redis_client):
    """``results(skip=...)``: a follower's second pass (``ocrq openai-batch submit --wait --out``)
    reads no part whose images it wrote already, and still gets the newly final ones."""
    index, store = job
    first = store_part(index, store, [doc(rec(i, ImageStatus.done, pages=1), f"text id{i}") for i in range(3)])
    reads: list[str] = []
    get_many = store.get_many

    def counting(paths, *, raw=False):
        paths = list(paths)
        reads.extend(paths)
        return get_many(paths, raw=raw)

    store.get_many = counting
    had = {r.record.id for r in results(index, store, "j") if r.record.status.final}
    assert had == {"id0", "id1", "id2"}
    assert keys.result_part("j", index.new_part("j")[0], first) in reads
    second = store_part(index, store, [doc(rec(i, ImageStatus.done, pages=1), f"text id{i}") for i in (3, 4)])
    reads.clear()
    got = {r.record.id: r for r in results(index, store, "j", skip=had.__contains__)}
    assert set(got) == {f"id{i}" for i in range(3, 8)}  # id5-id7: not final, as records
    assert got["id3"].outputs[0].text == "text id3"
    epoch = index.new_part("j")[0]
    assert keys.result_part("j", epoch, first) not in reads
    assert keys.result_part("j", epoch, second) in reads
