"""One redaction rule for everything ocrq shows or keeps: records, result documents, error
messages, task summaries (Flower, Celery's result backend, its log line) and task arguments as
Flower shows them (``argsrepr``).

A URL keeps its scheme, host, path and query keys; it loses the password of its userinfo and
every query value: a presigned S3 URL (``X-Amz-Signature``, ``X-Amz-Credential``,
``X-Amz-Security-Token``), a SAS token or an ``?access_token=`` would otherwise be readable by
anyone with Flower or the results. ``s3://`` and local refs are left alone (an S3 key may
legitimately contain ``?``; neither carries credentials). Free text gets every URL in it
redacted the same way.

``redact_message`` is the one rule for error messages: every ``OcrqError`` passes its message
through it when it is made, so what a record stores, a log line prints, Flower shows and an API
answers is the same redacted text. It redacts URLs as above, a ``user:password@`` left without its
scheme (a host name an error quotes), and cuts a message to ``MAX_MESSAGE_CHARS``: a hostile ref
may be megabytes long, and no message repeats it in full.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

REDACTED = "REDACTED"
#: a URL inside free text (an error message, a log line)
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]+://[^\s'\"<>]+(?<![.,:;)\]])")
_QUERY_VALUE = re.compile(r"=[^&;]*")
#: ``user:password@host`` without a scheme (what a socket error quotes of a URL's authority)
_BARE_USERINFO = re.compile(r"(?<![\w.%+-])([\w.%+-]*):[^\s/@:'\"]+@(?=[\w\[])")
#: an error message is cut to this many characters (what records, logs and answers show)
MAX_MESSAGE_CHARS = 2000
#: a reference shown inside a message or a record is cut to this many characters
MAX_SHOWN_REF_CHARS = 300


def redact_url(url: str) -> str:
    """``url`` without userinfo passwords and with every query value replaced (http, https,
    redis, rediss, amqp ...); ``s3://``, ``file://`` and plain paths unchanged."""
    scheme = url.partition(":")[0].lower()
    if "://" not in url or scheme in ("s3", "file"):
        return url
    try:
        parts = urlsplit(url)
    except ValueError:  # malformed: keep nothing after the authority
        return url.partition("?")[0].partition("@")[2] or url.partition("?")[0]
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, has_password, _ = userinfo.partition(":")
        netloc = f"{user}:{REDACTED}@{host}" if has_password else f"{REDACTED}@{host}"
    query = _QUERY_VALUE.sub(f"={REDACTED}", parts.query) if parts.query else ""
    if query == parts.query and netloc == parts.netloc:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """``text`` with every URL in it passed through ``redact_url``."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text) if "://" in text else text


def redact_message(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """An error message as ocrq keeps and shows it: URLs redacted (``redact_text``), a bare
    ``user:password@`` redacted, cut to ``limit`` characters (its length said)."""
    text = redact_text(text)
    if "@" in text:
        text = _BARE_USERINFO.sub(lambda m: f"{m.group(1)}:{REDACTED}@", text)
    return cut(text, limit)


def shown_ref(ref: str, limit: int = MAX_SHOWN_REF_CHARS) -> str:
    """A reference as a message or a record shows it: redacted, cut to ``limit`` characters."""
    return cut(redact_url(ref) if len(ref) <= 4 * limit else redact_text(ref[:4 * limit]), limit, len(ref))


def cut(text: str, limit: int, length: int | None = None) -> str:
    """``text`` within ``limit`` characters: cut, saying how long it was (``length``: the original's
    length when ``text`` is already a part of it)."""
    total = len(text) if length is None else length
    if total <= limit and len(text) <= limit:
        return text
    return f"{text[:limit]}… ({total:,} characters)"
