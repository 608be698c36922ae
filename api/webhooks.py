"""Webhooks: each job's terminal event POSTed to its URL, signed as the Standard Webhooks spec
says, retried until acknowledged (the outbox: ``ocrq.jobs.events``).

A webhook URL passes the rules an image URL does (http or https; a host that resolves to a
private, loopback or link-local address is refused) unless its host is in
``api.webhook_allow_hosts``; it is checked when a job names it and again at each attempt, which
connects to an address that lookup checked (``ocrq.net.fetch``'s pinned connections: a name that
re-resolves to an internal address is not followed). Redirects are not followed.

An attempt is acknowledged by any 2xx answer within ``api.webhook_timeout_s``; anything else is
tried again after ``api.webhook_retry_s`` (5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h), then given
up. Every attempt is listed in the job's deliveries (``GET /v1/jobs/{id}/deliveries``). The body
is built at the first attempt and kept, so every attempt sends the same bytes under the same
``webhook-id``; receivers verify ``webhook-signature`` with the tenant's secret (the
``standardwebhooks`` package, or any implementation of the spec).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from standardwebhooks.webhooks import Webhook

from api.tenants import Tenants
from ocrq import names
from ocrq.errors import OcrqError
from ocrq.jobs.events import Outbox
from ocrq.net.addresses import public_addresses
from ocrq.net.pinned import PinnedHTTP, PinnedHTTPS
from ocrq.redact import redact_text, redact_url
from ocrq.settings import LimitSettings, Settings
from producer.errors import Refused

log = logging.getLogger("ocrq.api.webhooks")

#: seconds between a deliverer's looks at the outbox when it found nothing due
POLL_S = 1.0


class WebhookRefused(Refused):
    code = "webhook_refused"


def _limits(settings: Settings, host: str) -> LimitSettings:
    allowed = host.lower() in {h.lower() for h in settings.api.webhook_allow_hosts}
    return settings.limits.model_copy(update={"http_allow_private": allowed or settings.limits.http_allow_private,
                                              "allowed_schemes": ["http", "https"], "http_max_redirects": 0,
                                              "http_timeout": settings.api.webhook_timeout_s})


def check_url(settings: Settings, url: str) -> str:
    """``url`` when a webhook may go there, else ``WebhookRefused`` saying why."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise WebhookRefused(f"webhook_url is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookRefused("webhook_url must be an http:// or https:// URL with a host")
    if parts.username or parts.password:
        raise WebhookRefused("webhook_url must not carry a user or password (put a secret in the path, "
                             "and verify the webhook-signature header)")
    try:
        public_addresses(parts.hostname, port, _limits(settings, parts.hostname))
    except OcrqError as exc:
        raise WebhookRefused(f"webhook_url {redact_url(url)}: {redact_text(str(exc))} (api.webhook_allow_hosts "
                             "lets a host through)") from None
    return url


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def post(settings: Settings, url: str, body: bytes, headers: dict[str, str]) -> int:
    """One attempt: the receiver's HTTP status (an error raised: unreachable, refused, timed out)."""
    host = urlsplit(url).hostname or ""
    limits = _limits(settings, host)
    opener = urllib.request.build_opener(_NoRedirects(), PinnedHTTP(limits), PinnedHTTPS(limits))
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={**headers, "Content-Type": "application/json", "User-Agent": "ocrq"})
    try:
        with opener.open(request, timeout=settings.api.webhook_timeout_s) as response:
            response.read(1 << 16)
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)


class Deliverer:
    """Claims due events from the outbox and sends them, in a thread of ``ocrq serve``."""

    def __init__(self, settings: Settings, redis: Any, tenants: Tenants,
                 payload: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.settings = settings
        self.outbox = Outbox(redis, settings.redis.job_ttl)
        self.tenants = tenants
        self.payload = payload
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ocrq-webhooks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.settings.api.webhook_timeout_s + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sent = self.deliver_due()
            except Exception:  # Redis away: the events wait in the outbox
                log.exception("! webhook delivery sweep failed")
                sent = 0
            if not sent:
                self._stop.wait(POLL_S)

    def deliver_due(self) -> int:
        """One sweep: every due event claimed, one attempt each; how many were attempted."""
        # a claimed event is another deliverer's after this long (an attempt takes at most the
        # timeout, twice over: connect and answer)
        window = 2 * self.settings.api.webhook_timeout_s + 1
        events = self.outbox.claim(window)
        for event in events:
            self.attempt(event)
        return len(events)

    def attempt(self, event: dict[str, Any]) -> None:
        tenant_name = names.tenant_of(event["job"])
        tenant = self.tenants.get(tenant_name)
        secret = tenant.settings.webhook_secret if tenant is not None else None
        if "body" not in event:  # built once: every attempt sends the same bytes
            event["body"] = json.dumps({"type": event["type"], "timestamp": _iso(event["created"]),
                                        "data": self.payload(event)}, separators=(",", ":"))
            self.outbox.save(event)
        event["attempts"] = int(event.get("attempts", 0)) + 1
        started = time.time()
        status: int | None = None
        error: str | None = None
        if secret is None:
            error = f"tenant {tenant_name} has no webhook_secret (`ocrq token create` makes one)"
        else:
            try:
                check_url(self.settings, event["url"])
                msg_id = "msg_" + event["id"].replace("#", "_").replace("~", "_")
                stamp = datetime.fromtimestamp(started, tz=UTC)
                signature = Webhook(secret.get_secret_value()).sign(msg_id, stamp, event["body"])
                status = post(self.settings, event["url"], event["body"].encode(), {
                    "webhook-id": msg_id, "webhook-timestamp": str(int(stamp.timestamp())),
                    "webhook-signature": signature})
            except Exception as exc:
                error = redact_text(f"{type(exc).__name__}: {exc}")[:500]
        delivered = status is not None and 200 <= status < 300
        self.outbox.record_attempt(event["job"], {
            "event": event["id"], "type": event["type"], "attempt": event["attempts"], "at": started,
            "url": redact_url(event["url"]), "status": status, "error": error, "delivered": delivered,
            "seconds": round(time.time() - started, 3)})
        schedule = self.settings.api.webhook_retry_s
        if delivered or event["attempts"] > len(schedule):
            if not delivered:
                log.warning("! webhook %s of job=%s given up after %d attempts", event["type"], event["job"],
                            event["attempts"])
            self.outbox.settle(event, None)
        else:
            self.outbox.settle(event, time.time() + schedule[event["attempts"] - 1])


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=UTC).isoformat().replace("+00:00", "Z")
