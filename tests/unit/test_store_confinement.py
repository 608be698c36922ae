"""Every store refuses a path that would leave its root, whoever asks, before any I/O: the local
files (``ocrq.store.local_store``), the local SQLite store (``ocrq.store.sqlite_store``) and S3
(``ocrq.store.storage.S3Store``; botocore's Stubber plays S3 with no answer queued, so a request that
went out would fail the test)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from ocrq import keys
from ocrq.errors import RefusedKey
from ocrq.store.local_store import LocalStore
from ocrq.store.sqlite_store import SqliteStore
from ocrq.store.storage import S3Store

#: what a job name from a hostile message made of a store path, and other ways out
ESCAPES = [
    keys.export_object("../../../../../../tmp/x", keys.EXPORT_JSONL),
    "results/../../outside.json",
    "/etc/passwd",
    "results//j/a.json",
    "results/./a.json",
    "..",
    "results/j/a\x00.json",
    "results\\..\\..\\x.json",
    "results/j/" + "a" * 2000 + ".json",
    "",
]


@pytest.fixture()
def s3() -> Iterator[S3Store]:
    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s")
    with Stubber(client) as stub:
        yield S3Store(client, "b", "ocrq/")
        stub.assert_no_pending_responses()


def _stores(tmp_path: Path, s3: S3Store) -> dict[str, Any]:
    return {"local files": LocalStore(tmp_path / "files"), "sqlite": SqliteStore(tmp_path / "db"), "s3": s3}


def _calls(store: Any, path: str, spool: Path) -> list[Callable[[], Any]]:
    return [
        lambda: store.put_json(path, {"x": 1}),
        lambda: store.put_many([(keys.result_object("j", "a"), {"ok": 1}), (path, {"x": 1})]),
        lambda: store.put_many([(path, b"x")], new=[path]),
        lambda: store.get_json(path),
        lambda: store.get_many([path], raw=True),
        lambda: store.put_file(path, spool, "application/x-ndjson"),
        lambda: store.delete(path),
        lambda: store.delete_many([path]),
        lambda: list(store.list(path if path.endswith("/") else path + "/")),
    ]


@pytest.mark.parametrize("kind", ["local files", "sqlite", "s3"])
def test_every_store_refuses_a_path_that_leaves_its_root(kind: str, tmp_path: Path, s3: S3Store) -> None:
    store = _stores(tmp_path, s3)[kind]
    spool = tmp_path / "spool.jsonl"
    spool.write_text("{}\n")
    before = set(Path("/tmp").glob("x*"))
    for path in ESCAPES:
        for n, call in enumerate(_calls(store, path, spool)):
            if n == 8 and path in ("", "/etc/passwd"):
                continue  # ("" + "/" is "/": checked below; a listing of "" is the whole store)
            with pytest.raises(RefusedKey):
                call()
    # nothing was written anywhere: not outside, and not the good document of the refused batch
    assert set(Path("/tmp").glob("x*")) == before
    assert not (tmp_path / "tmp").exists() and not (tmp_path / "outside.json").exists()
    if kind != "s3":
        assert store.get_json(keys.result_object("j", "a")) is None
    with pytest.raises(RefusedKey):
        list(store.list("/"))


@pytest.mark.parametrize("kind", ["local files", "sqlite"])
def test_paths_ocrq_writes_still_work(kind: str, tmp_path: Path, s3: S3Store) -> None:
    store = _stores(tmp_path, s3)[kind]
    for path in (keys.result_part("acme~invoices-2026", "e1", 3), keys.export_object("j.b_c-d", "_SUCCESS"),
                 keys.cache_object("ab" * 32 + ".rapidocr-3.4.text.0123456789abcdef"),
                 keys.inline_input("acme~j", "cd" * 32)):
        store.put_json(path, {"p": path})
        assert store.get_json(path) == {"p": path}
    assert list(store.list("")) != []


def test_a_symlink_inside_the_local_store_cannot_point_a_write_outside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "store"
    (root / "results").mkdir(parents=True)
    os.symlink(outside, root / "results" / "j")
    store = LocalStore(root)
    with pytest.raises(RefusedKey, match="resolves outside"):
        store.put_json(keys.export_object("j", keys.EXPORT_SUCCESS), {"x": 1})
    with pytest.raises(RefusedKey):
        store.get_json("results/j/a.json")
    assert list(outside.iterdir()) == []
