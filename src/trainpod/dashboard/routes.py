"""The dashboard's routes: pages under ``/ui`` and the htmx fragments that keep them live.

Each page is rendered whole once; its live part is a fragment the page polls (htmx
``hx-trigger="every …"``) and swaps in place, so nothing reloads. A job's log follows with a
poller that carries the offset it has read to: each answer appends the new text and
replaces the poller with one at the new offset (and at the next attempt after a restart).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from trainpod.api.models import JobInfo
from trainpod.api.params import ROW_MAX, JobId, MaybeJob, Offset, Rank
from trainpod.controller.access import Action, Principal
from trainpod.controller.core import Controller
from trainpod.controller.launch import rank_log_path, read_log_chunk
from trainpod.dashboard import panels
from trainpod.dashboard.auth import LOGIN, clear_login, set_login
from trainpod.errors import Forbidden
from trainpod.telemetry.goodput import GoodputReport, compute_goodput

HERE = Path(__file__).parent
HISTORY_PAGE = 50
"""Ended jobs per page of the history (pages go by id: as cheap at 10,000 jobs as at 10)."""
WAITING_SHOWN = 100
"""Waiting jobs listed (the first in scheduling order); the rest are counted."""
GOODPUT_WINDOW = 20
"""The cluster's goodput is over the jobs that hold nodes and the newest ended ones."""
REFRESH_S = 2
Resolve = Callable[[str], Principal | None]


def _principal(request: Request) -> Principal:
    who = request.state.principal
    assert isinstance(who, Principal)
    return who


Who = Annotated[Principal, Depends(_principal)]


def mount(app: FastAPI, controller: Controller, *, resolve: Resolve) -> None:
    """Serve the dashboard from ``app``: its pages, fragments and static files."""
    app.include_router(dashboard_router(controller, resolve=resolve))
    app.mount("/ui/static", StaticFiles(directory=HERE / "static"), name="ui-static")


LOGIN_FORM: dict[str, Any] = {
    "requestBody": {
        "content": {
            "application/x-www-form-urlencoded": {
                "schema": {"type": "object", "properties": {"token": {"type": "string"}}}
            }
        }
    }
}
"""The login form as the schema tells it (the route reads the body itself)."""


def dashboard_router(controller: Controller, *, resolve: Resolve) -> APIRouter:
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.globals.update(
        clock=panels.clock,
        first_line=panels.first_line,
        span=panels.span,
        size=panels.size,
        refresh_s=REFRESH_S,
        colours=panels.BUCKET_COLOURS,
    )
    reports = _GoodputCache()
    # In the OpenAPI schema (tag "dashboard") so that the API's fuzz reaches these too.
    router = APIRouter(prefix="/ui", tags=["dashboard"])

    def render(request: Request, name: str, who: Principal | None, **ctx: Any) -> HTMLResponse:
        now = controller.clock.now()
        ctx = {"who": who, "now": now, "cluster": controller.cfg.cluster, **ctx}
        return templates.TemplateResponse(request, name, ctx)

    # -- login ----------------------------------------------------------------------------
    @router.get("", response_class=RedirectResponse)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/queue", status_code=303)

    @router.get("/login", response_class=HTMLResponse)
    def login_page(request: Request) -> HTMLResponse:
        return render(request, "login.html", None, error="")

    @router.post("/login", response_class=HTMLResponse, openapi_extra=LOGIN_FORM)
    async def login(request: Request) -> Response:
        form = parse_qs((await request.body()).decode("utf-8", errors="replace"))
        token = (form.get("token") or [""])[0].strip()
        who = resolve(token) if token else None
        if who is None or who.role == "agent":
            error = (
                "paste a token first"
                if not token
                else "that is not a user's token: ask an admin for one "
                "(`trainpod users add NAME`), or use the cluster's admin.token"
            )
            refused = render(request, "login.html", None, error=error)
            refused.status_code = 401
            return refused
        response = RedirectResponse("/ui/queue", status_code=303)
        set_login(response, token, secure=request.url.scheme == "https")
        return response

    @router.post("/logout")
    def logout() -> Response:
        response = RedirectResponse(LOGIN, status_code=303)
        clear_login(response)
        return response

    # -- the queue and the cluster --------------------------------------------------------
    def queue_ctx(before: int | None) -> dict[str, Any]:
        live = controller.job_infos(include_ended=False)
        ended = controller.views.ended(before, HISTORY_PAGE)
        nodes, jobs = controller.counts()
        newest = controller.views.ended(None, GOODPUT_WINDOW)
        holding = panels.holding(live)
        now = controller.clock.now()
        goodput = panels.cluster_goodput(
            reports.of(j, controller, now) for j in [*holding, *newest]
        )
        waiting = panels.waiting_in_order(live)
        return {
            "waiting": waiting[:WAITING_SHOWN],
            "waiting_more": max(0, len(waiting) - WAITING_SHOWN),
            "holding": holding,
            "history": ended,
            "before": before,
            "next_before": ended[-1].id if len(ended) == HISTORY_PAGE else None,
            "node_counts": nodes,
            "job_counts": jobs,
            "goodput": goodput,
            "restarts": panels.restarts,
        }

    @router.get("/queue", response_class=HTMLResponse)
    def queue(request: Request, who: Who, before: MaybeJob = None) -> HTMLResponse:
        return render(request, "queue.html", who, page="queue", **queue_ctx(before))

    @router.get("/fragments/queue", response_class=HTMLResponse)
    def queue_fragment(request: Request, who: Who, before: MaybeJob = None) -> HTMLResponse:
        return render(request, "_queue.html", who, **queue_ctx(before))

    # -- a job ----------------------------------------------------------------------------
    def job_ctx(job_id: int) -> dict[str, Any]:
        job = controller.job_info(job_id)
        events = controller.event_infos(job_id=job_id)
        points = controller.progress_history(job_id)
        report = compute_goodput(job, events, controller.clock.now())
        with_uploads = (job.progress or {}).get("checkpoint_uploads") or {}
        return {
            "job": job,
            "report": report,
            "goodput_chart": panels.goodput_chart(report),
            "charts": panels.progress_charts(points),
            "points": len(points),
            "has_loss": panels.has_loss(points),
            "last_point": points[-1] if points else None,
            "tiers": panels.checkpoint_tiers(events),
            "uploads": with_uploads,
            "timeline": panels.timeline(events),
            "restarts": panels.restarts(job),
        }

    @router.get("/jobs/{job_id}", response_class=HTMLResponse)
    def job_page(request: Request, who: Who, job_id: JobId, rank: Rank = 0) -> HTMLResponse:
        ctx = job_ctx(job_id)
        refused = _may_read_logs(controller, who, job_id)
        ranks = _ranks(ctx["job"])
        return render(
            request, "job.html", who, page="job", rank=rank, ranks=ranks, refused=refused, **ctx
        )

    @router.get("/fragments/jobs/{job_id}", response_class=HTMLResponse)
    def job_fragment(request: Request, who: Who, job_id: JobId) -> HTMLResponse:
        return render(request, "_job.html", who, **job_ctx(job_id))

    @router.get("/fragments/jobs/{job_id}/log", response_class=HTMLResponse)
    def log_fragment(
        request: Request,
        who: Who,
        job_id: JobId,
        rank: Rank = 0,
        attempt: Annotated[int, Query(ge=0, le=ROW_MAX, description="0: the latest")] = 0,
        offset: Offset = 0,
    ) -> HTMLResponse:
        refused = _may_read_logs(controller, who, job_id)
        if refused:
            return render(request, "_log.html", who, refused=refused, job_id=job_id)
        job = controller.job_info(job_id)
        latest = job.attempts[-1].number if job.attempts else 0
        number = attempt or latest
        data, new_offset = "", offset
        if number:
            path = rank_log_path(controller.cfg, job_id, number, rank)
            data, new_offset = read_log_chunk(path, offset)
        marker = ""
        if not data and number and latest > number:  # read to the end: on to the next
            number, new_offset = number + 1, 0
            marker = f"--- attempt {number} ---\n"
        if not number and latest:
            number = latest
        follow = not (job.state.ended and not data and number >= latest)
        return render(
            request,
            "_log.html",
            who,
            refused="",
            job_id=job_id,
            rank=rank,
            attempt=number,
            offset=new_offset,
            text=marker + data,
            follow=follow,
            first=attempt == 0 and offset == 0,
        )

    # -- nodes and teams ------------------------------------------------------------------
    @router.get("/nodes", response_class=HTMLResponse)
    def nodes(request: Request, who: Who) -> HTMLResponse:
        return render(request, "nodes.html", who, page="nodes", nodes=controller.node_infos())

    @router.get("/fragments/nodes", response_class=HTMLResponse)
    def nodes_fragment(request: Request, who: Who) -> HTMLResponse:
        return render(request, "_nodes.html", who, nodes=controller.node_infos())

    def teams_ctx() -> dict[str, Any]:
        live = controller.job_infos(include_ended=False)
        return {"teams": panels.teams(controller.cfg, live)}

    @router.get("/teams", response_class=HTMLResponse)
    def teams(request: Request, who: Who) -> HTMLResponse:
        return render(request, "teams.html", who, page="teams", **teams_ctx())

    @router.get("/fragments/teams", response_class=HTMLResponse)
    def teams_fragment(request: Request, who: Who) -> HTMLResponse:
        return render(request, "_teams.html", who, **teams_ctx())

    return router


def _may_read_logs(controller: Controller, who: Principal, job_id: int) -> str:
    """Empty if ``who`` may read the job's logs, else the refusal (recorded once per view:
    the log's poller stops at a refusal)."""
    try:
        controller.authorize(who, Action.READ_LOGS, job_id)
    except Forbidden as exc:
        return str(exc)
    return ""


def _ranks(job: JobInfo) -> list[int]:
    return list(range(job.spec.nodes * (job.spec.procs_per_node or 1)))


class _GoodputCache:
    """Goodput reports of ended jobs, which never change, kept by job (bounded); live jobs'
    are computed afresh each time."""

    MAX = 1_000

    def __init__(self) -> None:
        self._ended: dict[int, GoodputReport] = {}

    def of(self, job: JobInfo, controller: Controller, now: float) -> GoodputReport:
        cached = self._ended.get(job.id)
        if cached is not None:
            return cached
        report = compute_goodput(job, controller.event_infos(job_id=job.id), now)
        if job.state.ended:
            if len(self._ended) >= self.MAX:
                self._ended.pop(next(iter(self._ended)))
            self._ended[job.id] = report
        return report
