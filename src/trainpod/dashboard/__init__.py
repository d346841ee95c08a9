"""The web dashboard the controller serves under ``/ui`` (docs/decisions/0020-dashboard-stack.md).

Server-rendered HTML (Jinja2) with htmx polling fragments for live updates and Chart.js for
the charts, both vendored under ``static/vendor`` (no CDN: clusters often have no internet).
Read-only: every page shows what the JSON API shows, and a login page turns a pasted token
into an HttpOnly, ``SameSite=Strict`` cookie that the API's ``BearerAuth`` accepts for
``/ui`` and for the read-only (GET) JSON routes the pages read.
"""

from trainpod.dashboard.auth import COOKIE, cookie_token, is_ui, login_redirect, public_path
from trainpod.dashboard.routes import dashboard_router, mount

__all__ = [
    "COOKIE",
    "cookie_token",
    "dashboard_router",
    "is_ui",
    "login_redirect",
    "mount",
    "public_path",
]
