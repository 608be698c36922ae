"""The durable store: S3 (or MinIO/moto) in production, a local directory in the embedded default
(one SQLite database, ``ocrq.store.sqlite_store``; ``ocrq.store.local_store`` is the earlier one-file-per-document
layout, still read).

Both hold JSON documents at the paths defined in ``ocrq.keys``; writes are whole-object and
idempotent (same key, same content), so a redelivered message can rewrite them safely.
The exception is a result part (``keys.result_part``): its name comes from a Redis counter, which a
failover or a crash can set back, so it is written as new (``put_many``'s ``new``: S3's
``If-None-Match: *``, SQLite's plain INSERT, a hard link on disk) and never replaces another.
A missing object reads as ``None``; other failures raise ``StorageUnavailable`` (retryable) locally,
and on S3 whatever ``ocrq.s3errors.s3_error`` maps them to (the same mapping refs use).

Every store refuses a path outside the grammar of ``ocrq.keys.check_store_path`` (``RefusedKey``:
``..``, an absolute path, a control character) before any request, whoever the caller: a job
name from a hostile message cannot step out of its folder, nor out of the S3 prefix (some
S3-compatible servers normalise ``..`` in a key).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from ocrq.errors import MissingObject, NameTaken, StorageUnavailable
from ocrq.keys import check_store_path
from ocrq.s3errors import s3_error
from ocrq.settings import StoreSettings
from ocrq.store.docbytes import dumps_doc

log = logging.getLogger(__name__)


class ResultStore(Protocol):
    #: human-readable location, e.g. "s3://bucket/prefix/" or "/abs/var/store/"
    location: str

    def put_json(self, path: str, doc: Any) -> None: ...

    def get_json(self, path: str) -> Any | None: ...

    def put_many(self, items: Sequence[tuple[str, Any]], *, new: Collection[str] = ()) -> None:
        """Store every (path, document) of a chunk; raises if any could not be stored. The paths
        in ``new`` are only created: one that exists raises ``NameTaken`` and is left as it is."""
        ...

    def get_many(self, paths: Iterable[str], *, raw: bool = False) -> dict[str, Any]:
        """The documents found, by path (missing ones are absent); ``raw``: their JSON bytes."""
        ...

    def list(self, prefix: str) -> Iterator[str]: ...

    def put_file(self, path: str, local: Path, content_type: str) -> None: ...

    def open_file(self, path: str) -> BinaryIO | None:
        """A file written with ``put_file`` (an export, an upload), opened to read as a stream
        (the caller closes it); None when there is none."""
        ...

    def delete_file(self, path: str) -> None:
        """Delete a file written with ``put_file`` (a missing one too)."""
        ...

    def delete(self, path: str) -> None: ...

    def delete_many(self, paths: Iterable[str]) -> None:
        """Delete every path (missing ones too): S3 deletes 1,000 per request."""
        ...


def make_s3_client(store: StoreSettings) -> Any:
    """A boto3 S3 client for the configured endpoint (credentials: settings, else boto3's chain)."""
    import boto3
    from botocore.config import Config

    kwargs: dict[str, Any] = {
        "endpoint_url": store.endpoint_url,
        "region_name": store.region,
        # adaptive retries absorb S3 throttling before we surface StorageUnavailable
        "config": Config(retries={"max_attempts": 5, "mode": "adaptive"}, max_pool_connections=32),
    }
    if store.access_key_id and store.secret_access_key:
        kwargs["aws_access_key_id"] = store.access_key_id.get_secret_value()
        kwargs["aws_secret_access_key"] = store.secret_access_key.get_secret_value()
    return boto3.client("s3", **kwargs)


#: concurrent requests of one ``put_many`` / ``get_many`` (within the client's 32 connections)
_S3_THREADS = 16


class S3Store:
    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self.location = f"s3://{bucket}/{self.prefix}"
        self._pool: ThreadPoolExecutor | None = None
        #: create-only writes (``put_many``'s ``new``) with If-None-Match: off once the store
        #: answers NotImplemented
        self.conditional_writes = True

    def _map(self, fn: Any, items: Iterable[Any]) -> list[Any]:
        """One request per object, ``_S3_THREADS`` at a time (S3 has no batch put or get)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_S3_THREADS, thread_name_prefix="ocrq-s3")
        return list(self._pool.map(fn, items))

    def put_many(self, items: Sequence[tuple[str, Any]], *, new: Collection[str] = ()) -> None:
        for path, _ in items:  # every path checked before the first request
            check_store_path(path)
        self._map(lambda kv: self._put(kv[0], kv[1], new=kv[0] in new), items)

    def get_many(self, paths: Iterable[str], *, raw: bool = False) -> dict[str, Any]:
        wanted = [check_store_path(p) for p in dict.fromkeys(paths)]
        docs = self._map(lambda p: self._get(p, raw), wanted)
        return {p: d for p, d in zip(wanted, docs, strict=True) if d is not None}

    def put_json(self, path: str, doc: Any) -> None:
        self._put(path, doc)

    def _put(self, path: str, doc: Any, new: bool = False) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        # S3 conditional writes (AWS since 2024-08, MinIO, moto); a store that refuses the header
        # as not implemented gets plain writes from then on (what every write was before), said once
        check_store_path(path)
        only_new = {"IfNoneMatch": "*"} if new and self.conditional_writes else {}
        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self.prefix + path, Body=dumps_doc(doc),
                ContentType="application/json", **only_new,
            )
        except (BotoCoreError, ClientError) as exc:
            code = exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else None
            if only_new and code in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise NameTaken(f"{self.location}{path} exists ({code})") from exc
            if only_new and code == "NotImplemented":
                self.conditional_writes = False
                log.warning("! %s does not implement If-None-Match on PUT: result parts are written "
                            "without it (a Redis failover could then let one chunk's part replace another's)",
                            self.location)
                self._put(path, doc)
                return
            raise s3_error(exc, f"{self.location}{path} (put)") from exc

    def get_json(self, path: str) -> Any | None:
        return self._get(path, False)

    def _get(self, path: str, raw: bool) -> Any | None:
        from botocore.exceptions import BotoCoreError, ClientError

        check_store_path(path)
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self.prefix + path)
            data = obj["Body"].read()
            return data if raw else json.loads(data)
        except (BotoCoreError, ClientError) as exc:
            err = s3_error(exc, f"{self.location}{path} (get)")
            if isinstance(err, MissingObject):
                return None
            raise err from exc

    def put_file(self, path: str, local: Path, content_type: str) -> None:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        check_store_path(path)
        try:  # multipart above boto3's threshold: an export may be gigabytes
            self.client.upload_file(str(local), self.bucket, self.prefix + path,
                                    ExtraArgs={"ContentType": content_type})
        except (BotoCoreError, ClientError) as exc:
            raise s3_error(exc, f"{self.location}{path} (upload)") from exc
        except (S3UploadFailedError, OSError) as exc:  # the transfer manager wraps the S3 answer
            raise StorageUnavailable(f"S3 upload {self.location}{path}: {exc}") from exc

    def open_file(self, path: str) -> BinaryIO | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            body: BinaryIO = self.client.get_object(Bucket=self.bucket, Key=self.prefix + path)["Body"]
            return body
        except (BotoCoreError, ClientError) as exc:
            err = s3_error(exc, f"{self.location}{path} (get)")
            if isinstance(err, MissingObject):
                return None
            raise err from exc

    def delete_file(self, path: str) -> None:
        self.delete(path)

    def delete(self, path: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        check_store_path(path)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.prefix + path)
        except (BotoCoreError, ClientError) as exc:
            raise s3_error(exc, f"{self.location}{path} (delete)") from exc

    def delete_many(self, paths: Iterable[str]) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        todo = iter(paths)
        while group := [check_store_path(p) for p in islice(todo, 1000)]:
            try:
                out = self.client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": self.prefix + p} for p in group], "Quiet": True})
            except (BotoCoreError, ClientError) as exc:
                raise s3_error(exc, f"{self.location} (delete of {len(group)} objects)") from exc
            if out.get("Errors"):
                first = out["Errors"][0]
                raise StorageUnavailable(f"S3 delete {self.location}{first.get('Key')}: {first.get('Message')}"
                                         f" ({len(out['Errors'])} of {len(group)} not deleted)")

    def list(self, prefix: str) -> Iterator[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        check_store_path(prefix, prefix=True)
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix
            )
            for page in pages:
                for item in page.get("Contents", []):
                    yield item["Key"][len(self.prefix):]
        except (BotoCoreError, ClientError) as exc:
            raise s3_error(exc, f"{self.location}{prefix} (list)") from exc


def make_store(store: StoreSettings, s3_client: Any | None = None) -> ResultStore:
    if store.kind == "s3":
        return S3Store(s3_client or make_s3_client(store), store.bucket, store.prefix)
    from ocrq.store.sqlite_store import SqliteStore

    return SqliteStore(store.path)
