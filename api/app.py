"""The ASGI app of ``ocrq serve``: the jobs API, OpenAI Files and Batches, health, and the webhook
deliverer; one error shape for every failure (``producer.errors``: each error knows its status).

    uvicorn --factory api.app:app_from_env      # or: ocrq serve
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from kombu.exceptions import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api import health, jobs, openai_batches, openai_files, pages
from api.service import Service
from api.uploads import InvalidRequest
from api.webhooks import Deliverer
from ocrq import names
from ocrq.errors import OcrqError
from ocrq.settings import Settings, load_settings
from producer.errors import ClientError, Unreachable

log = logging.getLogger("ocrq.api")

VERSION = "1"
#: Swagger UI's files (swagger-ui-dist, Apache-2.0), for /docs
SWAGGER = Path(__file__).parent / "swagger"


def create_app(settings: Settings) -> FastAPI:
    svc = Service(settings)
    deliverer = Deliverer(settings, svc.redis, svc.tenants, lambda event: event_payload(svc, event))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.api.deliver_webhooks:
            deliverer.start()
        yield
        deliverer.stop()
        svc.close()

    app = FastAPI(title="ocrq", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="OCR jobs over HTTP: submit image refs, follow, cancel, read results; "
                              "OpenAI-compatible Files and Batches; signed webhooks.")
    # /docs from files shipped with the package: machines without internet (most of ours) get it too
    app.mount("/docs-assets", StaticFiles(directory=SWAGGER), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="ocrq API",
                                   swagger_js_url="/docs-assets/swagger-ui-bundle.js",
                                   swagger_css_url="/docs-assets/swagger-ui.css",
                                   swagger_favicon_url="/docs-assets/favicon-32x32.png")

    app.state.service = svc
    app.state.deliverer = deliverer
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(openai_files.router)
    app.include_router(openai_batches.router)
    pages.install(app)  # the jobs pages: /, /jobs/{id}, /fleet, /login (api.pages)
    app.add_exception_handler(ClientError, _client_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(OcrqError, _ocrq_error)
    app.add_exception_handler(redis.exceptions.ConnectionError, _redis_down)
    app.add_exception_handler(redis.exceptions.TimeoutError, _redis_down)
    app.add_exception_handler(OperationalError, _redis_down)  # a publish the broker would not take
    return app


def app_from_env() -> FastAPI:
    """The app on the settings of this process's environment (``OCRQ_*``, ``OCRQ_CONFIG``)."""
    return create_app(load_settings())


def event_payload(svc: Service, event: dict[str, Any]) -> dict[str, Any]:
    """What a webhook says: the job (or batch) as ``GET`` returns it when the event is first sent."""
    job = event["job"]
    meta = svc.client.index.meta(job)
    if meta.get("object") == "batch":
        return openai_batches.batch_view(svc, job)
    found = jobs.view(svc, job)
    found["tenant"] = names.tenant_of(job)
    return found


def _respond(exc: ClientError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.http_status, headers=exc.headers())


async def _client_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ClientError)
    return _respond(exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:10]]
    return _respond(InvalidRequest("; ".join(problems)))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """What the framework itself refuses (a body it cannot parse, too many form fields, an unknown
    route), in the API's one error shape."""
    assert isinstance(exc, StarletteHTTPException)
    error = {"type": "HTTPError", "code": f"http_{exc.status_code}", "message": str(exc.detail)}
    return JSONResponse({"error": error}, status_code=exc.status_code, headers=exc.headers)


class _Failed(ClientError):
    http_status = 422
    code = "refused"


class _Unavailable(ClientError):
    http_status = 503
    code = "unavailable"


async def _ocrq_error(request: Request, exc: Exception) -> JSONResponse:
    """An error of the tree below the client's (a store away, a source refused): permanent ones
    are the request's (422), retryable ones the service's (503)."""
    assert isinstance(exc, OcrqError)
    cls = _Unavailable if exc.retryable else _Failed
    return _respond(cls(f"{type(exc).__name__}: {exc}"))


async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
    log.warning("! Redis unreachable: %s", exc)
    return _respond(Unreachable("Redis cannot be reached: try again later"))
