"""The local store (the embedded default): one SQLite database under ``store.path``.

The same documents at the same paths as on S3 (``ocrq.keys``), held as rows of one WAL-mode
database (``{store.path}/store.sqlite3``) instead of one file per document: creating a small file
costs 0.1–0.9 ms on this kind of disk (docs/bench/overhead.md), two per image, while a chunk's
documents go in as one transaction. Writes are idempotent upserts; a committed transaction
survives the writer being killed (WAL, ``synchronous=NORMAL``), so "written before ack" holds.
Several processes on one host may share it (readers never block; writers wait up to
``_BUSY_S``). It is a single-host store: put it on a local disk, not NFS.

Documents written by earlier versions as files under ``store.path`` (``results/{job}/{id}.json``
...) are still read and listed (``LocalStore``), so upgrading keeps old results visible.

A job's export (``results/{job}/export/``: results.jsonl, results.parquet, ``_SUCCESS``) is the
exception: it is written as plain files under ``store.path`` (``LocalStore``), where Spark,
DuckDB, pandas or a file sensor read it, exactly as they would under an S3 prefix.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from ocrq.errors import NameTaken, StorageUnavailable
from ocrq.keys import check_store_path, is_export_object
from ocrq.store.docbytes import dumps_doc
from ocrq.store.local_store import LocalStore

DB_NAME = "store.sqlite3"
#: how long a writer waits for another process's transaction before StorageUnavailable
_BUSY_S = 60.0
#: bound parameters per SELECT ... IN (SQLite's default limit is 32,766; stay well under it)
_IN_BATCH = 500

#: a rowid table (new rows append to its last page) with the path index beside it: a chunk's
#: documents have random paths, and a WITHOUT ROWID table keeps ~700-byte documents inside its
#: path B-tree, where each insert dirtied (and often split) its own page; 2.5-3x less CPU per
#: insert, and absent paths (cache misses) are found in the small index (docs/bench/overhead.md).
#: Databases created as WITHOUT ROWID by earlier versions are used as they are.
_SCHEMA = "CREATE TABLE IF NOT EXISTS objects (path TEXT PRIMARY KEY, doc BLOB NOT NULL)"


class SqliteStore:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.location = str(self.root) + "/"
        self.db = self.root / DB_NAME
        self._legacy = LocalStore(self.root)
        self._local = threading.local()
        self._has_legacy: bool | None = None

    # --- connection (one per thread: sqlite3 connections are not shared across threads) ------

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(self.db, timeout=_BUSY_S, isolation_level=None, check_same_thread=False)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute(_SCHEMA)
            except (OSError, sqlite3.Error) as exc:
                raise StorageUnavailable(f"local store {self.db}: {exc}") from exc
            self._local.conn = conn
        return conn

    def _legacy_files(self) -> bool:
        """Whether documents from the file layout exist (checked once: later ones are rows)."""
        if self._has_legacy is None:
            # (results/ alone may hold nothing but exports, which are files in this layout too)
            self._has_legacy = (any((self.root / d).is_dir() for d in ("cache", "failed"))
                                or any(self.root.glob("results/*/*.json")))
        return self._has_legacy

    # --- the ResultStore protocol --------------------------------------------------------------

    def put_json(self, path: str, doc: Any) -> None:
        self.put_many([(path, doc)])

    def put_many(self, items: Sequence[tuple[str, Any]], *, new: Collection[str] = ()) -> None:
        """Every document in one transaction: all of them are stored, or none and it raises
        (``NameTaken`` where a path of ``new`` exists)."""
        for path, _ in items:  # a path leaving the root refuses the whole write, before any I/O
            check_store_path(path)
        files = [(path, doc) for path, doc in items if is_export_object(path)]
        if files:  # the export's marker: a file beside the export's data files
            self._legacy.put_many(files, new=new)
        rows: list[tuple[str, bytes]] = []
        fresh: list[tuple[str, bytes]] = []
        for path, doc in items:
            if not is_export_object(path):
                (fresh if path in new else rows).append((path, dumps_doc(doc)))
        if not rows and not fresh:
            return
        conn = self._conn()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany("INSERT INTO objects (path, doc) VALUES (?, ?)", fresh)
                conn.executemany("INSERT OR REPLACE INTO objects (path, doc) VALUES (?, ?)", rows)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except sqlite3.IntegrityError as exc:
            raise NameTaken(f"local store {self.db}: one of {sorted(p for p, _ in fresh)} exists") from exc
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"local store write ({len(rows)} documents) {self.db}: {exc}") from exc

    def get_json(self, path: str) -> Any | None:
        return self.get_many([path]).get(path)

    def get_many(self, paths: Iterable[str], *, raw: bool = False) -> dict[str, Any]:
        """The documents found, by path (missing ones are absent); ``raw``: their JSON bytes."""
        wanted = [check_store_path(p) for p in dict.fromkeys(paths)]
        found: dict[str, Any] = self._legacy.get_many([p for p in wanted if is_export_object(p)], raw=raw)
        wanted = [p for p in wanted if p not in found]
        conn = self._conn()
        try:
            for start in range(0, len(wanted), _IN_BATCH):
                part = wanted[start:start + _IN_BATCH]
                marks = ",".join("?" * len(part))
                for path, doc in conn.execute(f"SELECT path, doc FROM objects WHERE path IN ({marks})", part):
                    found[path] = doc if raw else json.loads(doc)
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"local store read {self.db}: {exc}") from exc
        if self._legacy_files():
            for path in wanted:
                if path not in found and (doc := self._legacy.get_many([path], raw=raw).get(path)) is not None:
                    found[path] = doc
        return found

    def list(self, prefix: str) -> Iterator[str]:
        check_store_path(prefix, prefix=True)
        try:
            rows = self._conn().execute(
                "SELECT path FROM objects WHERE path >= ? AND path < ? ORDER BY path",
                (prefix, prefix + "\U0010ffff"),
            ).fetchall()
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"local store list {self.db}: {exc}") from exc
        paths = [p for (p,) in rows]
        if self._legacy_files():
            paths = sorted(set(paths).union(self._legacy.list(prefix)))
        yield from paths

    def put_file(self, path: str, local: Path, content_type: str) -> None:
        """A job's export file (large, read by other tools): a plain file under ``store.path``."""
        check_store_path(path)
        self._legacy.put_file(path, local, content_type)

    def open_file(self, path: str) -> BinaryIO | None:
        return self._legacy.open_file(path)

    def delete_file(self, path: str) -> None:
        self._legacy.delete(path)

    def delete_many(self, paths: Iterable[str]) -> None:
        for path in paths:  # (one statement each: deletes are rare, a reprocess or an archive)
            self.delete(path)

    def delete(self, path: str) -> None:
        if is_export_object(check_store_path(path)):
            self._legacy.delete(path)
            return
        try:
            self._conn().execute("DELETE FROM objects WHERE path = ?", (path,))
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"local store delete {self.db}: {exc}") from exc
        if self._legacy_files():
            self._legacy.delete(path)
