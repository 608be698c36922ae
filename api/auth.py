"""Who is asking: a bearer token (``Authorization: Bearer ocrq_…``), or the jobs page's login
cookie holding one; each request of a tenant counts towards its request rate."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from api.service import Service
from api.tenants import Tenant

#: the jobs page's login cookie (HTTP-only; holds the token the login form was given)
COOKIE = "ocrq_token"


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


async def caller(request: Request) -> Caller:
    """The request's tenant (401 without a known token; 429 past its request rate). Async: on the
    event loop, not a thread of the pool (a Redis round trip on loopback is shorter than the hop)."""
    svc = service(request)
    tenant = svc.tenants.authenticate(token_of(request))
    svc.check_rate(tenant)
    return Caller(svc, tenant)


async def unmetered(request: Request) -> Caller:
    """The request's tenant, its rate counted by the route itself in the pipeline of its first
    read (``Service.count_request``: one Redis round trip a request, where it reads anyway)."""
    svc = service(request)
    return Caller(svc, svc.tenants.authenticate(token_of(request)))
