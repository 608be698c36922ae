"""The jobs pages of ``ocrq serve``: what the people who own jobs look at in a browser.

    /login, /logout        sign in with a tenant's bearer token (kept in an HTTP-only cookie)
    /                      the tenant's jobs, newest first, by state, a page at a time
    /jobs/{id}             one job: counts, plots, failures by type, export, webhooks, cancel, reprocess
    /fleet                 workers, queues by priority, the broker's memory; links to Flower, Prometheus
    /live/...              the small JSON each page polls (every ``POLL_MS``) to update without reloading

Server-rendered HTML (Jinja2, autoescaped) that works without JavaScript; the scripts under
``api/static/`` update the numbers, bars and plots in place (never stealing keyboard focus).
Pages read what the API reads (``api.views``, ``producer.Client``) under the same tenant rules:
another tenant's job is unknown (404). Actions are POST forms behind a confirm page, each with
the sign-in's CSRF token (``api.pages_signin``). Every response carries a strict Content
Security Policy: scripts and styles from this origin only.

Nothing is kept for a browser: nothing in Redis for a sign-in (the token is the cookie), so the pages add no
Redis key and no memory per user, and any replica answers any request. What a request reads is
bounded whatever the number of jobs (``api.pages_data``, ``api.pages_fleet``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import redis
from fastapi import APIRouter, Depends, FastAPI, Form, Query, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.templating import Jinja2Templates

from api import pages_data, pages_fleet, pages_signin
from api import pages_format as fmt
from api.auth import Caller, service, token_of
from api.auth import signed_in_caller as caller  # (the forms check their own CSRF token)
from api.views import FINAL_STATES, STATES
from producer.errors import ClientError, Unauthorized, UnknownJob

log = logging.getLogger("ocrq.api.pages")

HERE = Path(__file__).resolve().parent
STATIC = HERE / "static"
TEMPLATES = HERE / "templates"
#: how often a page asks for fresh numbers
POLL_MS = 1500
#: every page's headers: scripts, styles and images from this origin only, no framing, no referrer
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
#: what a notice in a page's query says (never the query's own text)
NOTICES = {"cancelled": "Cancel sent: images not started will not run; the job ends once the running ones finish.",
           "reprocessed": "{n} image(s) queued again.", "nothing": "Nothing to run again."}


def _static_version() -> str:
    digest = hashlib.sha256()
    for path in sorted(STATIC.glob("*")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


_env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]), trim_blocks=True,
                   lstrip_blocks=True)
_VERSION = _static_version()
_env.globals.update(static=lambda name: f"/static/{name}?v={_VERSION}", states=STATES, poll_ms=POLL_MS,
                    fmt=fmt)
_env.filters["q"] = lambda v: quote(str(v), safe="")
templates = Jinja2Templates(env=_env)


def _page(request: Request, name: str, status: int = 200, **context: Any) -> Response:
    return templates.TemplateResponse(request, name, context, status_code=status, headers=HEADERS)


def _error_page(request: Request, status: int, title: str, message: str) -> Response:
    token = token_of(request)
    return _page(request, "error.html", status, title=title, message=message, tenant=None,
                 csrf=pages_signin.csrf_token(token) if token else "")


class PageRoute(APIRoute):
    """A page's route: a client error is an HTML page (not signed in: to sign-in), not JSON."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def page_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except Unauthorized:
                target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                return RedirectResponse("/login?" + urlencode({"next": target}), 303, headers=HEADERS)
            except ClientError as exc:
                titles = {404: "Not found", 403: "Refused", 429: "Slow down"}
                return _error_page(request, exc.http_status, titles.get(exc.http_status, "Refused"),
                                   exc.body()["error"]["message"])
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                log.warning("! Redis unreachable: %s", exc)
                return _error_page(request, 503, "Unavailable", "Redis cannot be reached: try again in a moment.")

        return page_handler


router = APIRouter(route_class=PageRoute, include_in_schema=False)
live = APIRouter(prefix="/live", include_in_schema=False)


def install(app: FastAPI) -> None:
    """The pages, their live JSON and their static files, on ``app``."""
    app.include_router(router)
    app.include_router(live)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")


def _common(who: Caller, request: Request, nav: str) -> dict[str, Any]:
    token = token_of(request) or ""
    return {"tenant": who.tenant.name, "csrf": pages_signin.csrf_token(token), "nav": nav}


def _state(state: str | None) -> str | None:
    if state in (None, ""):
        return None
    if state not in STATES:
        raise UnknownJob(str(state)[:40], "state")
    return state


# --- sign in, sign out ----------------------------------------------------------------------

@router.get("/login")
def login_form(request: Request, next: str | None = Query(None, max_length=2000)) -> Response:
    svc = service(request)
    target = pages_signin.local_path(next)
    try:
        svc.tenants.authenticate(request.cookies.get(pages_signin.COOKIE))
        return RedirectResponse(target, 303, headers=HEADERS)
    except Unauthorized:
        pass
    return _login(request, target)


def _login(request: Request, target: str, error: str | None = None, status: int = 200) -> Response:
    nonce = pages_signin.login_nonce()
    response = _page(request, "login.html", status, tenant=None, next=target, error=error, nonce=nonce)
    pages_signin.keep_login_nonce(response, service(request).settings, request, nonce)
    return response


@router.post("/login")
def login(request: Request, token: str = Form("", max_length=500), nonce: str = Form("", max_length=200),
          next: str = Form("/", max_length=2000)) -> Response:
    svc = service(request)
    target = pages_signin.local_path(next)
    pages_signin.check_login_nonce(request, nonce)
    try:
        tenant = svc.tenants.authenticate(token.strip())
    except Unauthorized:
        return _login(request, target, "This token is not known: check it, or make one with "
                                       "`ocrq token create --tenant NAME`.", 401)
    svc.check_rate(tenant)
    response = RedirectResponse(target, 303, headers=HEADERS)
    pages_signin.sign_in(response, svc.settings, request, token.strip())
    return response


@router.post("/logout")
def logout(request: Request, csrf: str = Form("", max_length=200)) -> Response:
    pages_signin.check_csrf(request, csrf)
    response = RedirectResponse("/login", 303, headers=HEADERS)
    pages_signin.sign_out(response, service(request).settings, request)
    return response


# --- jobs -----------------------------------------------------------------------------------

@router.get("/")
def jobs(request: Request, who: Caller = Depends(caller), state: str | None = Query(None, max_length=40),
         after: str | None = Query(None, max_length=200)) -> Response:
    chosen = _state(state)
    page = pages_data.jobs_page(who.svc, who.tenant, chosen, after)
    return _page(request, "jobs.html", **_common(who, request, "jobs"), page=page, state=chosen,
                 live_url=_url("/live/jobs", chosen, after), blank=_blank_row(),
                 links={"newer": _url("/", chosen, page["newer"]) if page["newer"] is not None else None,
                        "newest": _url("/", chosen, None) if page["first"] > 1 else None,
                        "older": _url("/", chosen, page["next"]) if page["next"] else None})


def _url(path: str, state: str | None, after: str | None) -> str:
    query = urlencode({k: v for k, v in (("state", state), ("after", after)) if v})
    return path + (f"?{query}" if query else "")


@live.get("/jobs")
def live_jobs(who: Caller = Depends(caller), state: str | None = Query(None, max_length=40),
              after: str | None = Query(None, max_length=200)) -> JSONResponse:
    page = pages_data.jobs_page(who.svc, who.tenant, _state(state), after)
    return JSONResponse(page, headers={"Cache-Control": "no-store"})


def _blank_row() -> dict[str, Any]:
    return fmt.row({"id": "", "state": "queued", "counts": {"total": 0}, "images_per_second": None,
                    "eta_seconds": None, "cost": {"usd": None}, "created_at": 0, "task": ""})


@router.get("/jobs/{job_id}")
def job(request: Request, job_id: str, who: Caller = Depends(caller),
        notice: str | None = Query(None, max_length=20), n: int = Query(0, ge=0, le=10**9)) -> Response:
    page = pages_data.job_page(who.svc, who.tenant, job_id)
    text = NOTICES.get(notice or "", "").format(n=f"{n:,}") or None
    return _page(request, "job.html", **_common(who, request, "jobs"), page=page, view=page["view"],
                 live=pages_data.live_job(page), notice=text, final=page["view"]["state"] in FINAL_STATES)


@live.get("/jobs/{job_id}")
def live_job(job_id: str, who: Caller = Depends(caller)) -> JSONResponse:
    page = pages_data.job_numbers(who.svc, who.tenant, job_id)
    return JSONResponse(pages_data.live_job(page), headers={"Cache-Control": "no-store"})


@router.get("/jobs/{job_id}/cancel")
def cancel_confirm(request: Request, job_id: str, who: Caller = Depends(caller)) -> Response:
    page = pages_data.job_numbers(who.svc, who.tenant, job_id)
    return _page(request, "confirm.html", **_common(who, request, "jobs"), action="cancel", view=page["view"],
                 error=None, final=page["view"]["state"] in FINAL_STATES)


@router.post("/jobs/{job_id}/cancel")
def cancel(request: Request, job_id: str, who: Caller = Depends(caller), csrf: str = Form("", max_length=200)
           ) -> Response:
    pages_signin.check_csrf(request, csrf)
    job = who.svc.existing(who.tenant, job_id)
    who.svc.client.cancel(job)
    return RedirectResponse(f"/jobs/{quote(job_id)}?notice=cancelled", 303, headers=HEADERS)


@router.get("/jobs/{job_id}/reprocess")
def reprocess_confirm(request: Request, job_id: str, who: Caller = Depends(caller),
                      error: str | None = Query(None, max_length=64)) -> Response:
    page = pages_data.job_page(who.svc, who.tenant, job_id)
    groups = {g["type"]: g for g in page["failures"]["groups"]}
    return _page(request, "confirm.html", **_common(who, request, "jobs"), action="reprocess", view=page["view"],
                 error=error or None, group=groups.get(error or ""), failures=page["failures"])


@router.post("/jobs/{job_id}/reprocess")
def reprocess(request: Request, job_id: str, who: Caller = Depends(caller), csrf: str = Form("", max_length=200),
              error: str = Form("", max_length=64)) -> Response:
    pages_signin.check_csrf(request, csrf)
    svc = who.svc
    job = svc.existing(who.tenant, job_id)
    svc.mark_active(who.tenant, job)
    n = svc.client.reprocess_failed(job, error=error or None)
    target = f"/jobs/{quote(job_id)}?" + urlencode({"notice": "reprocessed" if n else "nothing", "n": n})
    return RedirectResponse(target, 303, headers=HEADERS)


# --- fleet ----------------------------------------------------------------------------------

@router.get("/fleet")
def fleet(request: Request, who: Caller = Depends(caller)) -> Response:
    return _page(request, "fleet.html", **_common(who, request, "fleet"), fleet=pages_fleet.fleet_page(who.svc))


@live.get("/fleet")
def live_fleet(who: Caller = Depends(caller)) -> JSONResponse:
    return JSONResponse(pages_fleet.fleet_page(who.svc), headers={"Cache-Control": "no-store"})
