"""The local store (ocrq.store.sqlite_store): documents as rows of one database, a job's export as files."""

from __future__ import annotations

import json
from pathlib import Path

from ocrq import keys
from ocrq.settings import StoreSettings
from ocrq.store.sqlite_store import DB_NAME, SqliteStore
from ocrq.store.storage import make_store


def test_documents_are_rows_and_read_back_in_batches(tmp_path: Path) -> None:
    store = make_store(StoreSettings(path=tmp_path))
    assert isinstance(store, SqliteStore)
    docs = [(keys.result_object("j", f"i{n}"), {"n": n}) for n in range(3)]
    store.put_many(docs)
    assert (tmp_path / DB_NAME).is_file() and not (tmp_path / "results").exists()
    assert store.get_many([p for p, _ in docs] + ["results/j/missing.json"]) == dict(docs)
    assert json.loads(store.get_many([docs[0][0]], raw=True)[docs[0][0]]) == {"n": 0}
    assert list(store.list(keys.results_prefix("j"))) == sorted(p for p, _ in docs)
    store.delete(docs[0][0])
    assert store.get_json(docs[0][0]) is None


def test_a_jobs_export_is_plain_files_beside_its_marker(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)
    store.put_json(keys.result_object("j", "a"), {"x": 1})
    jsonl = tmp_path / "spool.jsonl"
    jsonl.write_text('{"id": "a"}\n')
    store.put_file(keys.export_object("j", keys.EXPORT_JSONL), jsonl, "application/x-ndjson")
    marker = keys.export_object("j", keys.EXPORT_SUCCESS)
    store.put_many([(marker, {"lines": 1})])
    # where Spark, DuckDB or a file sensor look for them: files under store.path
    assert (tmp_path / keys.export_object("j", keys.EXPORT_JSONL)).read_text() == '{"id": "a"}\n'
    assert json.loads((tmp_path / marker).read_text()) == {"lines": 1}
    assert store.get_json(marker) == {"lines": 1}
    # the export is not a result document: listing the job's results does not count it
    assert list(store.list(keys.results_prefix("j"))) == [keys.result_object("j", "a")]
    # a fresh handle (another process) still reads rows only from the database, the marker from disk
    again = SqliteStore(tmp_path)
    assert again.get_many([marker, keys.result_object("j", "a")]) == {marker: {"lines": 1},
                                                                      keys.result_object("j", "a"): {"x": 1}}
    again.delete(marker)
    assert not (tmp_path / marker).exists() and again.get_json(marker) is None
