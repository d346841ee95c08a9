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
    PreemptRequest,
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

    @app.post("/v1/jobs/{job_id}/preempt", response_model=JobInfo)
    def preempt(job_id: int, req: PreemptRequest | None = None) -> JobInfo:
        """Admins: stop a running job with a preemption notice and queue it again."""
        req = req or PreemptRequest()
        controller.preempt(job_id, req.reason, req.grace_s)
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
