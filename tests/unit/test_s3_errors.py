"""One S3 error mapping for references and the result store: the same S3 answer is the same
error wherever it happens. botocore's Stubber plays the S3 side (a fake, named so)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from ocrq.errors import MissingObject, OcrqError, RefusedRef, StorageUnavailable
from ocrq.net.fetch import fetch
from ocrq.settings import LimitSettings
from ocrq.store.storage import S3Store


@pytest.fixture()
def stubbed() -> Iterator[tuple[Any, Stubber]]:
    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s")
    with Stubber(client) as stub:
        yield client, stub


CASES = [
    ("AccessDenied", 403, RefusedRef),
    ("NoSuchKey", 404, MissingObject),
    ("SlowDown", 503, StorageUnavailable),
    ("InternalError", 500, StorageUnavailable),
    ("ExpiredToken", 400, StorageUnavailable),
]


def _outcome(call: Any) -> type[OcrqError] | None:
    try:
        call()
    except OcrqError as exc:
        return type(exc)
    return None


@pytest.mark.parametrize(("code", "status", "expected"), CASES)
def test_the_same_s3_answer_is_the_same_error_for_refs_and_the_store(
    stubbed: tuple[Any, Stubber], code: str, status: int, expected: type[OcrqError]
) -> None:
    client, stub = stubbed
    store = S3Store(client, "b", "p/")
    for op in ("get_object", "get_object", "put_object"):
        stub.add_client_error(op, service_error_code=code, http_status_code=status)
    ref = _outcome(lambda: fetch("s3://b/in/a.png", LimitSettings(), s3_client=client))
    read = _outcome(lambda: store.get_json("results/j/x.json"))
    write = _outcome(lambda: store.put_json("results/j/x.json", {"a": 1}))
    assert ref is expected
    # a missing result document reads as None; every other answer maps like the ref's
    assert read is (None if expected is MissingObject else expected)
    assert write is expected


def test_a_store_without_conditional_writes_gets_plain_ones_said_once(stubbed, caplog) -> None:
    """A part is written with If-None-Match: * (``put_many``'s ``new``); an S3-compatible store
    that answers NotImplemented gets the plain PUT instead, and no header from then on; a taken
    name is ``NameTaken``."""
    from ocrq.errors import NameTaken

    caplog.set_level(logging.WARNING)  # (an earlier test's library may have raised the capture level)
    client, stub = stubbed
    store = S3Store(client, "b", "p")
    conditional = {"Bucket": "b", "Key": "p/parts/1", "Body": b"x", "ContentType": "application/json",
                   "IfNoneMatch": "*"}
    plain = {k: v for k, v in conditional.items() if k != "IfNoneMatch"}
    stub.add_client_error("put_object", "PreconditionFailed", http_status_code=412, expected_params=conditional)
    with pytest.raises(NameTaken):
        store.put_many([("parts/1", b"x")], new=["parts/1"])
    stub.add_client_error("put_object", "NotImplemented", http_status_code=501, expected_params=conditional)
    stub.add_response("put_object", {}, plain)
    store.put_many([("parts/1", b"x")], new=["parts/1"])
    stub.add_response("put_object", {}, plain)
    store.put_many([("parts/1", b"x")], new=["parts/1"])
    stub.assert_no_pending_responses()
    assert store.conditional_writes is False
    assert sum("does not implement If-None-Match" in r.getMessage() for r in caplog.records) == 1
