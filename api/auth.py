"""Who is asking: a bearer token (``Authorization: Bearer ocrq_…``), or the jobs page's login
cookie holding one; each request of a tenant counts towards its request rate.

A browser sends the cookie with every request to this site, whoever made the page that asks
(SameSite=Strict keeps other sites out, not a sibling subdomain's page): a request that changes
something and is signed in by the cookie alone must carry the sign-in's CSRF token, in
``X-CSRF-Token`` (the API) or in its form (the pages' own forms, ``signed_in_caller``), or it is
refused (403). A bearer header is never sent by a browser on its own: it needs no CSRF token.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from fastapi import Request

from api.service import Service
from api.tenants import Tenant
from producer.errors import ClientError

#: the jobs page's login cookie (HTTP-only; holds the token the login form was given)
COOKIE = "ocrq_token"
#: the header a cookie-signed request that is not a read carries its CSRF token in
CSRF_HEADER = "x-csrf-token"
_SAFE = ("GET", "HEAD", "OPTIONS")
_CSRF_LABEL = b"ocrq-page-csrf-v1"


class Forbidden(ClientError):
    """A request signed in by the cookie that changes something, without its CSRF token."""

    http_status = 403
    code = "forbidden"


def csrf_token(token: str) -> str:
    """The CSRF token of the sign-in holding ``token``: an HMAC keyed by the token itself, so any
    replica checks it, and showing it reveals nothing of the token."""
    return hmac.new(token.encode(), _CSRF_LABEL, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Caller:
    svc: Service
    tenant: Tenant


def service(request: Request) -> Service:
    svc: Service = request.app.state.service
    return svc


def token_of(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.cookies.get(COOKIE) or None


def _bearer(request: Request) -> bool:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and bool(value.strip())


async def signed_in_caller(request: Request) -> Caller:
    """The request's tenant (401 without a known token; 429 past its request rate), for routes
    that check a CSRF token of their own (the pages' forms). Async, as every caller here: on the
    event loop, not a thread of the pool (a Redis round trip on loopback is shorter than the hop)."""
    svc = service(request)
    tenant = svc.tenants.authenticate(token_of(request))
    svc.check_rate(tenant)
    return Caller(svc, tenant)


async def caller(request: Request) -> Caller:
    """The request's tenant, as ``signed_in_caller``; a request that is not a read and is signed in
    by the cookie alone needs the sign-in's CSRF token in ``X-CSRF-Token`` (403)."""
    who = await signed_in_caller(request)
    if request.method not in _SAFE and not _bearer(request):
        sent = request.headers.get(CSRF_HEADER, "")
        if not hmac.compare_digest(csrf_token(token_of(request) or ""), sent):
            raise Forbidden("a request signed in by the pages' cookie must carry its CSRF token "
                            "(X-CSRF-Token); an API client sends Authorization: Bearer instead")
    return who


async def unmetered(request: Request) -> Caller:
    """``caller`` whose rate is counted by the route itself, in the pipeline of its first read
    (``Service.count_request``: one Redis round trip a request, where it reads anyway); a read
    only (GET), so the cookie needs no CSRF token."""
    svc = service(request)
    return Caller(svc, svc.tenants.authenticate(token_of(request)))
