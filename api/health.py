"""``/healthz`` (the process answers) and ``/readyz`` (Redis and the store answer too)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api.auth import service

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Redis or the store does not answer"}})
def readyz(request: Request) -> JSONResponse:
    svc = service(request)
    checks: dict[str, str] = {}
    try:
        svc.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:  # any failure is "not ready", said
        checks["redis"] = type(exc).__name__
    try:
        svc.client.store.get_json("readyz")  # a missing object reads as None: the store answered
        checks["store"] = "ok"
    except Exception as exc:
        checks["store"] = type(exc).__name__
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ready" if ready else "not ready", "checks": checks},
                        status_code=200 if ready else 503)
