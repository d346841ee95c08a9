"""The controller's HTTP API: versioned under /v1, a bearer token on every call."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from trainpod.api.models import (
    AllocationLease,
    ChaosOrder,
    ChaosRequest,
    ClusterInfo,
    EventInfo,
    Heartbeat,
    JobInfo,
    LaunchPlan,
    LogChunk,
    NodeAction,
    NodeInfo,
    Orders,
    ShellContext,
    StepEnd,
    StepPlan,
    StepRequest,
)
from trainpod.controller.core import Controller
from trainpod.controller.launch import rank_log_path
from trainpod.errors import Conflict, NotFound, SpecError, TrainpodError
from trainpod.spec.job import JobSpec
from trainpod.telemetry.goodput import compute_goodput

_STATUS = {SpecError: 400, NotFound: 404, Conflict: 409}
_MAX_LOG_CHUNK = 256 * 1024


def create_app(
    controller: Controller,
    *,
    admin_token: str,
    agent_token: str,
    info: Callable[[], ClusterInfo],
) -> FastAPI:
    app = FastAPI(
        title="trainpod controller",
        version="1",
        openapi_url="/v1/openapi.json",
        docs_url="/v1/docs",
        redoc_url=None,
    )

    app.add_middleware(BearerAuth, admin_token=admin_token, agent_token=agent_token)

    @app.exception_handler(TrainpodError)
    async def trainpod_error(_: Request, exc: TrainpodError) -> JSONResponse:
        status = next((s for t, s in _STATUS.items() if isinstance(exc, t)), 500)
        return JSONResponse({"error": type(exc).__name__, "message": str(exc)}, status_code=status)

    @app.get("/v1/cluster", response_model=ClusterInfo)
    def cluster() -> ClusterInfo:
        return info()

    @app.get("/v1/nodes", response_model=list[NodeInfo])
    def nodes() -> list[NodeInfo]:
        return controller.node_infos()

    @app.post("/v1/nodes/{name}/actions", response_model=NodeInfo)
    def node_action(name: str, action: NodeAction) -> NodeInfo:
        controller.node_action(name, action)
        return next(n for n in controller.node_infos() if n.name == name)

    @app.post("/v1/chaos", response_model=ChaosOrder, status_code=201)
    def chaos(req: ChaosRequest) -> ChaosOrder:
        return controller.chaos(req)

    @app.get("/v1/jobs/{job_id}/goodput")
    def goodput(job_id: int) -> dict[str, Any]:
        job = controller.job_info(job_id)
        events = controller.event_infos(job_id=job_id)
        return compute_goodput(job, events, time.time()).to_dict()

    @app.post("/v1/jobs", response_model=JobInfo, status_code=201)
    def submit(spec: JobSpec) -> JobInfo:
        return controller.job_info(controller.submit(spec))

    @app.post("/v1/jobs:plan", response_model=LaunchPlan)
    def plan(spec: JobSpec) -> LaunchPlan:
        return controller.plan(spec)

    @app.get("/v1/jobs", response_model=list[JobInfo])
    def jobs(all: bool = True, limit: int | None = None) -> Response:
        # Serialised by the views (ended jobs once), not validated again here.
        body = controller.jobs_json(include_ended=all, limit=limit)
        return Response(content=body, media_type="application/json")

    @app.get("/v1/jobs/{job_id}", response_model=JobInfo)
    def job(job_id: int) -> JobInfo:
        return controller.job_info(job_id)

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobInfo)
    def cancel(job_id: int) -> JobInfo:
        controller.cancel(job_id)
        return controller.job_info(job_id)

    @app.get("/v1/jobs/{job_id}/logs", response_model=LogChunk)
    def logs(job_id: int, rank: int = 0, attempt: int | None = None, offset: int = 0) -> LogChunk:
        info = controller.job_info(job_id)
        number = attempt or (info.attempts[-1].number if info.attempts else 0)
        ended = info.state in ("completed", "failed", "cancelled")
        data = ""
        if number:
            path = rank_log_path(controller.cfg, job_id, number, rank)
            data, offset = _read_from(path, offset)
        return LogChunk(
            job_id=job_id, attempt=number, rank=rank, offset=offset, data=data, job_ended=ended
        )

    @app.get("/v1/events", response_model=list[EventInfo])
    def events(
        job: int | None = None, node: str | None = None, after: int = 0, limit: int | None = None
    ) -> list[EventInfo]:
        return controller.event_infos(job_id=job, node=node, after=after, limit=limit)

    # -- interactive work: trainpod alloc / shell / run (controller/allocations.py) -------
    @app.post("/v1/jobs/{job_id}/lease", response_model=AllocationLease)
    def renew_lease(request: Request, job_id: int) -> AllocationLease:
        may_act_on_job(request, controller.job_info(job_id), "renew the allocation of")
        return controller.renew_allocation(job_id)

    @app.post("/v1/jobs/{job_id}/release", response_model=JobInfo)
    def release(request: Request, job_id: int, reason: str = "released") -> JobInfo:
        may_act_on_job(request, controller.job_info(job_id), "release the allocation of")
        controller.release_allocation(job_id, reason)
        return controller.job_info(job_id)

    @app.get("/v1/shell", response_model=ShellContext)
    def shell(request: Request, node: str | None = None, job: int | None = None) -> ShellContext:
        if job is not None:
            may_act_on_job(request, controller.job_info(job), "open a shell in")
        return controller.shell_context(node, job)

    @app.post("/v1/jobs/{job_id}/steps", response_model=StepPlan, status_code=201)
    def start_step(request: Request, job_id: int, req: StepRequest) -> StepPlan:
        may_act_on_job(request, controller.job_info(job_id), "run a step in")
        return controller.start_step(job_id, req)

    @app.post("/v1/jobs/{job_id}/steps/{step}/end", status_code=204)
    def end_step(request: Request, job_id: int, step: int, end: StepEnd) -> Response:
        may_act_on_job(request, controller.job_info(job_id), "end a step of")
        controller.end_step(job_id, step, end.exit_code)
        return Response(status_code=204)

    @app.post("/v1/agent/heartbeat", response_model=Orders)
    async def heartbeat(hb: Heartbeat) -> Response:
        # Recording takes the controller's lock (a worker thread); the long poll then waits
        # on the event loop, holding no thread, until the orders change or wait_s is up.
        orders, version = await anyio.to_thread.run_sync(controller.beat, hb)
        deadline = time.monotonic() + hb.wait_s
        while hb.wait_s > 0 and orders.hash == hb.orders_hash:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await controller.wake.changed_since(version, remaining):
                break
            orders, version = await anyio.to_thread.run_sync(controller.orders_for, hb.node)
        body = controller.stamp(orders).model_dump_json()
        return Response(content=body, media_type="application/json")  # built: not re-checked

    return app


def may_act_on_job(request: Request, job: JobInfo, action: str) -> None:
    """The one place the owner check of interactive work goes: only the job's owner or an
    admin may shell into, alloc into, run in or release a job.

    Today every caller holding the admin token is an admin, so nothing is refused. With
    per-user tokens: take the principal the auth middleware put on the request, and raise a
    403 (with ``action`` and ``job.id`` in the message, and an event) unless it is an admin
    or ``job.spec.user``.
    """
    del request, job, action


class BearerAuth:
    """Every call needs a bearer token: the admin token opens everything, the agents' token
    only ``/v1/agent/``. A plain ASGI middleware: Starlette's ``@app.middleware("http")``
    wraps every request and response in extra streams and tasks, a cost paid by every
    heartbeat of every agent."""

    def __init__(self, app: ASGIApp, *, admin_token: str, agent_token: str) -> None:
        self.app = app
        self._admin = admin_token.encode()
        self._agent = agent_token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        token = header[7:] if header[:7].lower() == b"bearer " else b""
        admin = bool(token) and secrets.compare_digest(token, self._admin)
        agent = bool(token) and secrets.compare_digest(token, self._agent)
        if admin or (agent and str(scope["path"]).startswith("/v1/agent/")):
            await self.app(scope, receive, send)
            return
        refused = JSONResponse(
            {"error": "Unauthorized", "message": "a valid bearer token is required; "
             "the CLI reads it from the cluster's state dir (admin.token)"},
            status_code=401,
        )  # fmt: skip
        await refused(scope, receive, send)


def _read_from(path: Path, offset: int) -> tuple[str, int]:
    """Up to a chunk of ``path`` from ``offset``: the text and the offset after it."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            raw = f.read(_MAX_LOG_CHUNK)
    except FileNotFoundError:
        return "", offset
    if len(raw) == _MAX_LOG_CHUNK:
        # Stop before a UTF-8 sequence cut in half; the next read starts at its first byte.
        cut = len(raw)
        while cut > 0 and len(raw) - cut < 4 and (raw[cut - 1] & 0xC0) == 0x80:
            cut -= 1
        if cut > 0 and raw[cut - 1] >= 0xC0:
            raw = raw[: cut - 1]
    return raw.decode("utf-8", errors="replace"), offset + len(raw)
