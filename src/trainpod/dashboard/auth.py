"""The dashboard's login: a pasted token kept in an HttpOnly, SameSite=Strict cookie.

The API's middleware (:class:`trainpod.api.app.BearerAuth`) resolves the caller; these are
the pieces of it that are the dashboard's: which ``/ui`` paths need no login, where the
cookie's token is read from, and what a request without a valid one gets (the login page).

CSRF: the cookie is ``SameSite=Strict`` (a browser never sends it on a request another site
started), ``HttpOnly`` (no script reads it) and ``Path=/`` so the pages' fetches of the JSON
API carry it; the middleware accepts it only on ``/ui`` and on GET/HEAD calls of the JSON API,
so a cookie alone can never change anything through ``/v1``. The dashboard itself only reads.
"""

from __future__ import annotations

from http.cookies import SimpleCookie

from starlette.responses import RedirectResponse, Response
from starlette.types import Receive, Scope, Send

COOKIE = "trainpod_token"
LOGIN = "/ui/login"
_PUBLIC = (LOGIN, "/ui/logout")
_STATIC = "/ui/static/"
COOKIE_MAX_AGE_S = 7 * 24 * 3600


def is_ui(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/")


def public_path(path: str) -> bool:
    """Dashboard paths served without a login: the login page itself and static files."""
    return path in _PUBLIC or path.startswith(_STATIC)


def cookie_token(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The dashboard cookie's token in a request's headers (empty if none)."""
    for key, value in headers:
        if key == b"cookie":
            jar: SimpleCookie = SimpleCookie()
            try:
                jar.load(value.decode("latin-1"))
            except Exception:  # a malformed Cookie header: as if there were none
                continue
            if COOKIE in jar:
                return jar[COOKIE].value.encode()
    return b""


async def login_redirect(scope: Scope, receive: Receive, send: Send) -> None:
    """No valid login: a page goes to the login page; an htmx fragment request gets a 401
    telling htmx to go there (a redirect would swap the login page into the fragment)."""
    headers = dict(scope["headers"])
    response: Response
    if headers.get(b"hx-request") == b"true":
        response = Response("login required", status_code=401, headers={"HX-Redirect": LOGIN})
    else:
        response = RedirectResponse(LOGIN, status_code=303)
    await response(scope, receive, send)


def set_login(response: Response, token: str, *, secure: bool) -> None:
    """``secure``: the login came over HTTPS (controller.tls), so the browser must send the
    cookie over HTTPS only."""
    response.set_cookie(
        COOKIE,
        token,
        max_age=COOKIE_MAX_AGE_S,
        path="/",
        httponly=True,
        samesite="strict",
        secure=secure,
    )


def clear_login(response: Response) -> None:
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
