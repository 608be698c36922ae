"""The earlier local layout of the durable store: one JSON file per document under ``store.path``.
Still read (``ocrq.store.sqlite_store`` falls back to it), and where exports are written as plain files.

Every path is checked twice before any I/O: against the grammar of store paths
(``ocrq.keys.check_store_path``: no ``..``, no absolute path), and the file it names, symlinks
followed, against the root (a symlink planted inside the store cannot point a write outside it).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from ocrq.errors import NameTaken, RefusedKey, StorageUnavailable
from ocrq.keys import check_store_path
from ocrq.store.docbytes import dumps_doc


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.location = str(self.root) + "/"

    def _path(self, path: str, prefix: bool = False) -> Path:
        target = self.root / check_store_path(path, prefix=prefix)
        resolved = os.path.realpath(target)
        root = str(self.root)
        if resolved != root and not resolved.startswith(root.rstrip("/") + "/"):
            raise RefusedKey(f"store path {path[:200]!r} resolves outside the store ({root})")
        return target

    def put_json(self, path: str, doc: Any) -> None:
        self._put(path, doc)

    def _put(self, path: str, doc: Any, new: bool = False) -> None:
        target = self._path(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # write-then-rename: readers never see half a document
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as fh:
                fh.write(dumps_doc(doc))
            if not new:
                os.replace(tmp, target)
                return
            try:  # a link fails where the name exists: created, never replaced
                os.link(tmp, target)
            except FileExistsError:
                raise NameTaken(f"{target} exists") from None
            finally:
                os.unlink(tmp)
        except OSError as exc:
            raise StorageUnavailable(f"local store write {target}: {exc}") from exc

    def put_many(self, items: Sequence[tuple[str, Any]], *, new: Collection[str] = ()) -> None:
        for path, _ in items:  # a path leaving the root refuses the whole write, before any I/O
            self._path(path)
        for path, doc in items:
            self._put(path, doc, new=path in new)

    def get_many(self, paths: Iterable[str], *, raw: bool = False) -> dict[str, Any]:
        return {p: doc for p in paths if (doc := self._get(p, raw)) is not None}

    def get_json(self, path: str) -> Any | None:
        return self._get(path, False)

    def _get(self, path: str, raw: bool) -> Any | None:
        try:
            data = self._path(path).read_bytes()
            return data if raw else json.loads(data)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageUnavailable(f"local store read {path}: {exc}") from exc

    def put_file(self, path: str, local: Path, content_type: str) -> None:
        target = self._path(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
            os.close(fd)
            shutil.copyfile(local, tmp)
            os.replace(tmp, target)
        except OSError as exc:
            raise StorageUnavailable(f"local store write {target}: {exc}") from exc

    def open_file(self, path: str) -> BinaryIO | None:
        try:
            return self._path(path).open("rb")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageUnavailable(f"local store read {path}: {exc}") from exc

    def delete_file(self, path: str) -> None:
        self.delete(path)

    def delete(self, path: str) -> None:
        try:
            self._path(path).unlink(missing_ok=True)
        except OSError as exc:
            raise StorageUnavailable(f"local store delete {path}: {exc}") from exc

    def delete_many(self, paths: Iterable[str]) -> None:
        for path in paths:
            self.delete(path)

    def list(self, prefix: str) -> Iterator[str]:
        base = self._path(prefix, prefix=True)
        if not base.is_dir():
            return
        for p in sorted(base.rglob("*.json")):
            yield str(p.relative_to(self.root))
