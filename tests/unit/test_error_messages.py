"""What an error message may say: every OcrqError is redacted when it is made (one rule,
ocrq.redact.redact_message), a URL with a password in it is refused at submit and on the worker,
and a decode error describes the file (size, format) without quoting any of its bytes."""

from __future__ import annotations

import logging

import pytest

from ocrq.errors import BadImage, EngineCrashed, HostNotFound, OcrqError, classify
from ocrq.net.fetch import fetch
from ocrq.redact import MAX_MESSAGE_CHARS, redact_message
from ocrq.refs import parse
from ocrq.settings import LimitSettings
from producer.expand import expand
from worker.decoding.images import decode, describe

PASSWORD = "pw-Zk81nQ"


def test_an_error_is_redacted_when_made_so_logs_records_and_answers_agree(caplog: pytest.LogCaptureFixture) -> None:
    err = HostNotFound(f"host does not resolve: alice:{PASSWORD}@files.example: [Errno -2]")
    assert PASSWORD not in str(err) and PASSWORD not in err.to_dict()["message"]
    assert "alice:REDACTED@files.example" in str(err)
    with caplog.at_level(logging.WARNING):
        logging.getLogger("t").warning("! failed: %s", err)
        logging.getLogger("t").warning("! failed: %r", err)
    assert PASSWORD not in caplog.text
    wrapped = classify(RuntimeError(f"boom https://u:{PASSWORD}@h/x?token={PASSWORD}"))
    assert isinstance(wrapped, EngineCrashed) and PASSWORD not in str(wrapped)
    long = OcrqError("x" * 10_000_000)
    assert len(str(long)) < MAX_MESSAGE_CHARS + 40 and "10,000,000 characters" in str(long)
    assert redact_message("at 12:30 job=a:b mail user@example.com") == "at 12:30 job=a:b mail user@example.com"


@pytest.mark.parametrize("url", [f"https://alice:{PASSWORD}@h.example/a.png", f"http://{PASSWORD}@h.example/a.png",
                                 f"https://alice:{PASSWORD}@h.example:8443/a.png?x=1"])
def test_a_url_with_credentials_is_refused_at_submit_and_on_the_worker(url: str) -> None:
    limits = LimitSettings(http_allow_private=True)
    with pytest.raises(Exception, match="user name or password") as info:
        parse(url, limits)
    assert PASSWORD not in str(info.value)
    (refused,) = expand([url], limits)
    assert refused.startswith("invalid:") and PASSWORD not in refused
    with pytest.raises(Exception, match="user name or password") as fetched:
        fetch(url, limits)  # the worker parses again: nothing is sent anywhere
    assert PASSWORD not in str(fetched.value)


@pytest.mark.parametrize(("data", "says"), [
    (f"ops:{PASSWORD}{PASSWORD}\n".encode(), "text of 23 bytes"),
    (b"\x89PNG\r\n\x1a\n" + PASSWORD.encode() * 4, "PNG image of 44 bytes"),
    (b"II*\x00" + PASSWORD.encode() * 8, "TIFF image"),
    (b'{"password": "' + PASSWORD.encode() + b'"}', "JSON of"),
    (bytes(range(256)) + PASSWORD.encode(), "binary data of 265 bytes"),
])
def test_a_decode_error_describes_the_file_and_quotes_none_of_it(data: bytes, says: str) -> None:
    with pytest.raises(BadImage) as info:
        decode(data, LimitSettings())
    message = str(info.value)
    assert says in message, message
    assert PASSWORD not in message and PASSWORD[:4] not in message and "\\x" not in message, message
    assert PASSWORD not in describe(data)
