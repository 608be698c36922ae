"""The jobs page's sign-in: a tenant's bearer token kept in an HTTP-only, SameSite=Strict cookie
(``api.auth.COOKIE``, which every API route reads too), and the CSRF token its forms carry.

Nothing is kept on the server: the CSRF token is an HMAC of the sign-in's own token (its key)
over a fixed label, so any replica checks it, a page that shows it reveals nothing of the token,
and another site can neither read it (the cookie is HTTP-only, the page same-origin) nor make one.
A POST without the right one is refused (403), on top of the cookie never riding a cross-site
request (SameSite=Strict). The sign-in form itself carries a one-time value it also sets in a
short-lived cookie (double submit), so another site cannot sign a browser in as someone else.
"""

from __future__ import annotations

import hmac
import secrets
from urllib.parse import urlsplit

from fastapi import Request, Response

from api.auth import COOKIE, Forbidden, csrf_token, token_of
from ocrq.settings import Settings

#: the sign-in form's double-submit cookie (lives as long as the form may stay open)
LOGIN_COOKIE = "ocrq_login"
LOGIN_COOKIE_S = 3600
#: how long a browser stays signed in (the token stays valid until revoked; this only bounds
#: how long an unattended browser holds it)
SIGN_IN_S = 12 * 3600


def check_csrf(request: Request, sent: str | None) -> None:
    """``Forbidden`` unless ``sent`` is the CSRF token of the request's own sign-in."""
    token = token_of(request)
    if not token or not sent or not hmac.compare_digest(csrf_token(token), sent):
        raise Forbidden("this form has expired or came from elsewhere: reload the page and try again")


def secure(settings: Settings, request: Request) -> bool:
    """Whether the cookies go over HTTPS only: ``api.cookie_secure``, else when the request came
    over HTTPS (itself, or a proxy's ``X-Forwarded-Proto``)."""
    if settings.api.cookie_secure is not None:
        return settings.api.cookie_secure
    forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return request.url.scheme == "https" or forwarded == "https"


def sign_in(response: Response, settings: Settings, request: Request, token: str) -> None:
    response.set_cookie(COOKIE, token, max_age=SIGN_IN_S, path="/", httponly=True, samesite="strict",
                        secure=secure(settings, request))
    response.delete_cookie(LOGIN_COOKIE, path="/login", httponly=True, samesite="strict",
                           secure=secure(settings, request))


def sign_out(response: Response, settings: Settings, request: Request) -> None:
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict", secure=secure(settings, request))


def login_nonce() -> str:
    """A fresh value for the sign-in form (``keep_login_nonce`` sets it in its cookie too)."""
    return secrets.token_urlsafe(24)


def keep_login_nonce(response: Response, settings: Settings, request: Request, nonce: str) -> None:
    response.set_cookie(LOGIN_COOKIE, nonce, max_age=LOGIN_COOKIE_S, path="/login", httponly=True,
                        samesite="strict", secure=secure(settings, request))


def check_login_nonce(request: Request, sent: str | None) -> None:
    kept = request.cookies.get(LOGIN_COOKIE)
    if not kept or not sent or not hmac.compare_digest(kept, sent):
        raise Forbidden("the sign-in form has expired: load it again")


def local_path(target: str | None, default: str = "/") -> str:
    """``target`` when it is a path of this site (where to go after signing in), else
    ``default``: never another host (``//evil``, ``/\\evil``, ``https://…``)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return default
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or any(ord(c) < 32 for c in target):
        return default
    return target
