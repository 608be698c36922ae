"""ocrq.redact and the message size caps: what Flower, records and results may show."""

from __future__ import annotations

import pytest

from ocrq.errors import MissingObject, RefusedRef, TooLarge
from ocrq.messages import Chunk, Item, checked_message, chunk_argsrepr
from ocrq.redact import redact_text, redact_url
from ocrq.refs import MAX_REF_CHARS, parse
from ocrq.settings import LimitSettings
from producer.expand import expand

SIGNED = ("https://bucket.s3.amazonaws.com/scans/a.png?X-Amz-Algorithm=AWS4-HMAC-SHA256"
          "&X-Amz-Credential=AKIAEXAMPLE%2F20261201%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Signature=deadbeef")


def test_presigned_url_keeps_its_path_and_loses_every_query_value() -> None:
    out = redact_url(SIGNED)
    assert out.startswith("https://bucket.s3.amazonaws.com/scans/a.png?X-Amz-Algorithm=REDACTED")
    assert "deadbeef" not in out and "AKIAEXAMPLE" not in out


def test_userinfo_and_plain_refs() -> None:
    assert redact_url("rediss://:pw@h:6380/0?ssl_cert_reqs=required") == "rediss://:REDACTED@h:6380/0?ssl_cert_reqs=REDACTED"
    assert redact_url("https://token@h/x.png") == "https://REDACTED@h/x.png"
    for ref in ("s3://b/k?v=1.png", "/data/a?b=c.png", "https://h/plain.png"):
        assert redact_url(ref) == ref


def test_error_messages_and_argsrepr_are_redacted() -> None:
    err = MissingObject(f"HTTP 404 for {SIGNED}: not found")
    assert "deadbeef" not in err.to_dict()["message"] and "not found" in err.to_dict()["message"]
    assert "deadbeef" not in redact_text(f"x {SIGNED}.")
    msg = Chunk(job="j", items=[Item(id="1", ref=SIGNED)]).to_message()
    assert "deadbeef" not in chunk_argsrepr(msg) and "scans/a.png" in chunk_argsrepr(msg)
    assert msg["items"][0]["ref"] == SIGNED  # the worker still gets the real ref


def test_size_caps() -> None:
    chunk = Chunk(job="j", params={"blob": "x" * 2000}, items=[Item(id="1", ref="/a.png")])
    assert checked_message(chunk, 4096)["job"] == "j"
    with pytest.raises(TooLarge, match="max_message_bytes"):
        checked_message(chunk, 1000)
    limits = LimitSettings(allowed_roots=["/"])
    with pytest.raises(RefusedRef, match="characters"):
        parse("/" + "a" * MAX_REF_CHARS, limits)
    (bad,) = expand(["https://h/" + "a" * MAX_REF_CHARS + "?sig=secret"], limits)
    assert bad.startswith("invalid:") and "secret" not in bad
