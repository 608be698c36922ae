"""One redaction rule for everything ocrq shows or keeps: records, result documents, error
messages, task summaries (Flower, Celery's result backend, its log line) and task arguments as
Flower shows them (``argsrepr``).

A URL keeps its scheme, host, path and query keys; it loses the password of its userinfo and
every query value: a presigned S3 URL (``X-Amz-Signature``, ``X-Amz-Credential``,
``X-Amz-Security-Token``), a SAS token or an ``?access_token=`` would otherwise be readable by
anyone with Flower or the results. ``s3://`` and local refs are left alone (an S3 key may
legitimately contain ``?``; neither carries credentials). Free text gets every URL in it
redacted the same way.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

REDACTED = "REDACTED"
#: a URL inside free text (an error message, a log line)
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]+://[^\s'\"<>]+(?<![.,:;)\]])")
_QUERY_VALUE = re.compile(r"=[^&;]*")


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
