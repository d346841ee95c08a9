"""The controller's HTTP API: versioned under /v1, a bearer token on every call."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio.to_thread
from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, ProcessCollector
from starlette.types import ASGIApp, Receive, Scope, Send

from trainpod.api.devices import DeviceTelemetry, EnergySummary, JobEnergy
from trainpod.api.heartbeat import (
    AgentDoor,
    BeatRunner,
    HeartbeatRoute,
    error_reply,
    serve_beat,
)
from trainpod.api.idempotency import REPLAYED, SUBMIT_RESPONSES, IdemKey, key_reused
from trainpod.api.models import (
    AllocationLease,
    ChaosOrder,
    ChaosRequest,
    ClusterInfo,
    EventInfo,
    Heartbeat,
    IssuedToken,
    JobInfo,
    LaunchPlan,
    LogChunk,
    NewToken,
    NodeAction,
    NodeInfo,
    Orders,
    PreemptRequest,
    RevokeRequest,
    ShellContext,
    StepEnd,
    StepPlan,
    StepRequest,
    TokenInfo,
    UserInfo,
    Whoami,
)
from trainpod.api.params import ROW_MAX, After, Count, JobId, MaybeJob, Offset, Rank, StepNo
from trainpod.api.throttle import AuthThrottle
from trainpod.controller.access import AGENT, Action, Principal, operator
from trainpod.controller.core import Controller
from trainpod.controller.idempotency import parse_key
from trainpod.controller.launch import rank_log_path, read_log_chunk
from trainpod.dashboard import cookie_token, is_ui, login_redirect, public_path
from trainpod.dashboard import mount as mount_dashboard
from trainpod.errors import IdempotencyKeyReused, TrainpodError
from trainpod.model.events import AuthFailed, AuthThrottled
from trainpod.spec.job import JobSpec
from trainpod.store.accounts import TokenRow, UserRow
from trainpod.telemetry.allocator import AllocatorMetrics
from trainpod.telemetry.exposition import CONTENT_TYPE, render
from trainpod.telemetry.goodput import compute_goodput

METRICS_PATH = "/metrics"
SCRAPER = Principal("prometheus", "user")
MAX_RECORDED_PATH = 256  # of a refused call's path, in its auth_failed event
"""The holder of the read-only scrape token (``scrape.token``): ``/metrics`` only."""


class ControllerApp(FastAPI):
    """The API, with the agents' heartbeats answered at its door
    (:class:`~trainpod.api.heartbeat.AgentDoor`), before FastAPI's middleware stack."""

    def __init__(self, door: AgentDoor, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._door = door

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._door.takes(scope):
            await serve_beat(self._door.runner, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(
    controller: Controller,
    *,
    admin_token: str,
    agent_token: str,
    info: Callable[[], ClusterInfo],
    scrape_token: str = "",
    on_shutdown: Callable[[], None] | None = None,
    throttle: AuthThrottle | None = None,
) -> FastAPI:
    """``scrape_token``: a read-only token that opens ``/metrics`` only (empty: none).
    ``on_shutdown``: run when the server stops serving (uvicorn re-raises a SIGTERM once it
    has shut down, so code after ``uvicorn.run`` never runs then).
    ``throttle``: limits failed authentications per client address (default: 10 a minute,
    loopback exempt; :mod:`trainpod.api.throttle`)."""
    beats = BeatRunner(controller)
    tokens = Tokens(
        admin_token=admin_token,
        agent_token=agent_token,
        operator=operator(controller.cfg.operator),
        users=controller.access.principal,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        beats.close()
        if on_shutdown is not None:
            on_shutdown()

    app = ControllerApp(
        AgentDoor(beats, tokens.principal),
        title="trainpod controller",
        version="1",
        openapi_url="/v1/openapi.json",
        docs_url="/v1/docs",
        redoc_url=None,
        lifespan=lifespan,
        # No OpenTelemetry: FastAPI's native telemetry asks on every request (each of
        # ~1,200 heartbeats a second) whether a tracer, meter or logger provider is set.
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )

    # Added first, so it runs inside BearerAuth: the token is checked as for every call.
    app.add_middleware(HeartbeatRoute, runner=beats)
    throttle = AuthThrottle() if throttle is None else throttle
    app.add_middleware(
        BearerAuth,
        tokens=tokens,
        scrape_token=scrape_token,
        throttle=throttle,
        on_auth_failed=controller.access.auth_failed,
    )
    mount_dashboard(app, controller, resolve=tokens.principal)  # /ui: the web dashboard
    registry = CollectorRegistry(auto_describe=False)
    registry.register(controller.metrics)
    registry.register(throttle)
    registry.register(AllocatorMetrics())  # native memory by holder (ADR 0045)
    ProcessCollector(registry=registry)  # process_resident_memory_bytes, CPU, descriptors

    @app.get(
        METRICS_PATH,
        tags=["metrics"],
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {}}}},
    )
    def metrics() -> Response:
        """Prometheus' text format, read from the controller's state at this scrape."""
        return Response(content=render(registry.collect()), media_type=CONTENT_TYPE)

    @app.exception_handler(TrainpodError)
    async def trainpod_error(_: Request, exc: TrainpodError) -> JSONResponse:
        status, body = error_reply(exc)
        return JSONResponse(body, status_code=status)

    app.add_exception_handler(IdempotencyKeyReused, key_reused)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A defect, never a refusal: JSON like every other error, the traceback in the log
        # (Starlette logs it after this answer).
        message = f"the controller failed on this call ({type(exc).__name__}); see its log"
        return JSONResponse({"error": "InternalError", "message": message}, status_code=500)

    @app.get("/v1/cluster", response_model=ClusterInfo)
    def cluster() -> ClusterInfo:
        return info()

    @app.get("/v1/nodes", response_model=list[NodeInfo])
    def nodes() -> list[NodeInfo]:
        return controller.node_infos()

    @app.get("/v1/nodes/{name}/telemetry", response_model=list[DeviceTelemetry])
    def node_telemetry(name: str) -> list[DeviceTelemetry]:
        """The node's devices with their last samples (about two minutes), oldest first."""
        return controller.node_telemetry(name)

    @app.post("/v1/nodes/{name}/actions", response_model=NodeInfo)
    def node_action(name: str, action: NodeAction, who: Caller) -> NodeInfo:
        controller.authorize(who, Action.MANAGE_NODES)
        controller.node_action(name, action)
        return next(n for n in controller.node_infos() if n.name == name)

    @app.post("/v1/chaos", response_model=ChaosOrder, status_code=201)
    def chaos(req: ChaosRequest, who: Caller) -> ChaosOrder:
        controller.authorize(who, Action.INJECT_FAULTS)
        return controller.chaos(req)

    @app.get("/v1/jobs/{job_id}/goodput")
    def goodput(job_id: JobId) -> dict[str, Any]:
        job = controller.job_info(job_id)
        events = controller.event_infos(job_id=job_id)
        return compute_goodput(job, events, time.time()).to_dict()

    @app.get("/v1/jobs/{job_id}/energy", response_model=JobEnergy)
    def job_energy(job_id: JobId) -> JobEnergy:
        """The job's energy per attempt and node, in kWh and kg CO2e."""
        return controller.energy.job(job_id)

    @app.get("/v1/energy", response_model=EnergySummary)
    def energy() -> EnergySummary:
        """Energy and CO2e per team, user and the whole cluster."""
        return controller.energy.summary()

    @app.post("/v1/jobs", response_model=JobInfo, status_code=201, responses=SUBMIT_RESPONSES)
    def submit(spec: JobSpec, who: Caller, response: Response, key: IdemKey = None) -> JobInfo:
        if key is None:
            return controller.job_info(controller.submit(spec, by=who), viewer=who)
        job_id, replayed = controller.submit_once(spec, who, parse_key(key))
        if replayed:
            response.headers[REPLAYED] = "true"
        return controller.job_info(job_id, viewer=who)

    @app.post("/v1/jobs:plan", response_model=LaunchPlan)
    def plan(spec: JobSpec, who: Caller) -> LaunchPlan:
        return controller.plan(spec, by=who)

    @app.get("/v1/whoami", response_model=Whoami)
    def whoami(who: Caller) -> Whoami:
        return Whoami(name=who.name, role=who.role, team=who.team, account=who.account)

    @app.get("/v1/users", response_model=list[UserInfo])
    def users(who: Caller) -> list[UserInfo]:
        return [_user_info(u, tokens) for u, tokens in controller.access.users(who)]

    @app.post("/v1/users", response_model=IssuedToken, status_code=201)
    def add_user(req: NewToken, who: Caller) -> IssuedToken:
        teams = {t.name for t in controller.cfg.teams}
        user, token, secret = controller.access.add_user(
            who, req.name, team=req.team, role=req.role, teams=teams
        )
        return IssuedToken(user=_user_info(user, [token]), token_id=token.id, token=secret)

    @app.post("/v1/users/{name}/revoke", response_model=list[str])
    def revoke(name: str, req: RevokeRequest, who: Caller) -> list[str]:
        return controller.access.revoke(who, name, req.token_id)

    @app.get("/v1/jobs", response_model=list[JobInfo])
    def jobs(who: Caller, all: bool = True, limit: Count = None, after: After = None) -> Response:
        # Serialised by the views (ended jobs once), not validated again here; env values
        # are the owner's and admins' (controller/access.py: sees_env). A page (`after`)
        # bounds what one call builds: a history of 100,000 jobs is ~140 MB of JSON at once.
        body = controller.jobs_json(include_ended=all, limit=limit, viewer=who, after=after)
        return Response(content=body, media_type="application/json")

    @app.get("/v1/jobs/{job_id}", response_model=JobInfo)
    def job(job_id: JobId, who: Caller) -> JobInfo:
        return controller.job_info(job_id, viewer=who)

    @app.post("/v1/jobs/{job_id}/hold", response_model=JobInfo)
    def hold(job_id: JobId, who: Caller) -> JobInfo:
        """Keep a waiting job in the queue, never placed, until released."""
        controller.hold(job_id, by=who)
        return controller.job_info(job_id, viewer=who)

    @app.delete("/v1/jobs/{job_id}/hold", response_model=JobInfo)
    def unhold(job_id: JobId, who: Caller) -> JobInfo:
        """Let a held job be scheduled again."""
        controller.hold(job_id, by=who, release=True)
        return controller.job_info(job_id, viewer=who)

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobInfo)
    def cancel(job_id: JobId, who: Caller) -> JobInfo:
        controller.cancel(job_id, by=who)
        return controller.job_info(job_id, viewer=who)

    @app.post("/v1/jobs/{job_id}/preempt", response_model=JobInfo)
    def preempt(job_id: JobId, who: Caller, req: PreemptRequest | None = None) -> JobInfo:
        """Admins: stop a running job with a preemption notice and queue it again."""
        controller.authorize(who, Action.PREEMPT, job_id)
        req = req or PreemptRequest()
        controller.preempt(job_id, req.reason, req.grace_s)
        return controller.job_info(job_id, viewer=who)

    @app.get("/v1/jobs/{job_id}/logs", response_model=LogChunk)
    def logs(
        job_id: JobId,
        who: Caller,
        rank: Rank = 0,
        attempt: Annotated[int | None, Query(ge=1, le=ROW_MAX)] = None,
        offset: Offset = 0,
    ) -> LogChunk:
        controller.authorize(who, Action.READ_LOGS, job_id)
        info = controller.job_info(job_id)
        number = attempt or (info.attempts[-1].number if info.attempts else 0)
        ended = info.state in ("completed", "failed", "cancelled")
        data = ""
        if number:
            path = rank_log_path(controller.cfg, job_id, number, rank)
            data, offset = read_log_chunk(path, offset)
        return LogChunk(
            job_id=job_id, attempt=number, rank=rank, offset=offset, data=data, job_ended=ended
        )

    @app.get("/v1/events", response_model=list[EventInfo])
    def events(
        job: MaybeJob = None,
        node: str | None = None,
        after: Annotated[int, Query(ge=0, le=ROW_MAX, description="events after this id")] = 0,
        limit: Count = None,
    ) -> list[EventInfo]:
        return controller.event_infos(job_id=job, node=node, after=after, limit=limit)

    # -- interactive work: trainpod alloc / shell / run (controller/interactive.py) ------
    # Only the job's owner or an admin (controller/access.py): a refusal is a 403 + event.
    @app.post("/v1/jobs/{job_id}/lease", response_model=AllocationLease)
    def renew_lease(job_id: JobId, who: Caller) -> AllocationLease:
        controller.authorize(who, Action.ALLOC, job_id)
        return controller.interactive.renew(job_id)

    @app.post("/v1/jobs/{job_id}/release", response_model=JobInfo)
    def release(job_id: JobId, who: Caller, reason: str = "released") -> JobInfo:
        controller.authorize(who, Action.ALLOC, job_id)
        controller.interactive.release(job_id, reason)
        return controller.job_info(job_id, viewer=who)

    @app.get("/v1/shell", response_model=ShellContext)
    def shell(who: Caller, node: str | None = None, job: MaybeJob = None) -> ShellContext:
        # A node's shell is a shell in the job it runs, if any: its owner's (or an admin's).
        held = job if job is not None or node is None else controller.interactive.job_on(node)
        controller.authorize(who, Action.SHELL, held)
        return controller.interactive.shell(node, job, by=who)

    @app.post("/v1/jobs/{job_id}/steps", response_model=StepPlan, status_code=201)
    def start_step(job_id: JobId, req: StepRequest, who: Caller) -> StepPlan:
        controller.authorize(who, Action.ALLOC, job_id)
        return controller.interactive.start_step(job_id, req)

    @app.post("/v1/jobs/{job_id}/steps/{step}/end", status_code=204)
    def end_step(job_id: JobId, step: StepNo, end: StepEnd, who: Caller) -> Response:
        controller.authorize(who, Action.ALLOC, job_id)
        controller.interactive.end_step(job_id, step, end.exit_code)
        return Response(status_code=204)

    @app.post("/v1/agent/heartbeat", response_model=Orders)
    async def heartbeat(hb: Heartbeat) -> Response:
        """An agent's report; the reply is its orders, held (a long poll, no thread held)
        up to ``wait_s`` while they equal those of ``orders_hash``. Served by
        :class:`~trainpod.api.heartbeat.HeartbeatRoute` before FastAPI routes it; declared
        here for the schema, and answered the same way should a call reach it."""
        body = await beats.answer(hb)
        return Response(content=body, media_type="application/json")  # built: not re-checked

    return app


class Tokens:
    """Which principal a token names: the admin token (the cluster's creator, an admin), the
    agents' token, or a user's token (None: none of them)."""

    def __init__(
        self,
        *,
        admin_token: str,
        agent_token: str,
        operator: Principal,
        users: Callable[[str], Principal | None],
    ) -> None:
        self._admin = admin_token.encode()
        self._agent = agent_token.encode()
        self._operator = operator
        self._users = users

    def principal(self, token: bytes | str) -> Principal | None:
        token = token.encode() if isinstance(token, str) else token
        if not token:
            return None
        if secrets.compare_digest(token, self._admin):
            return self._operator
        if secrets.compare_digest(token, self._agent):
            return AGENT
        try:
            return self._users(token.decode())
        except UnicodeDecodeError:
            return None


class BearerAuth:
    """Every call needs a bearer token, and is made as the principal it names: the admin
    token (the cluster's creator, an admin), the agents' token (only ``/v1/agent/``) or a
    user's token (everything but the agent API; what they may do there is the access
    policy's, :mod:`trainpod.controller.access`). The principal goes in the request's state.

    The dashboard (``/ui``) logs in with a cookie instead (:mod:`trainpod.dashboard.auth`):
    it is read for ``/ui`` and for GET/HEAD calls of the JSON API only, so a cookie alone
    never changes anything; without a valid one a page goes to the login page.

    A plain ASGI middleware: Starlette's ``@app.middleware("http")`` wraps every request and
    response in extra streams and tasks, a cost paid by every heartbeat of every agent."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        tokens: Tokens,
        scrape_token: str = "",
        throttle: AuthThrottle | None = None,
        on_auth_failed: Callable[[AuthFailed, AuthThrottled | None], None] = lambda *_: None,
    ) -> None:
        """``throttle``: failed authentications per client address (None: unlimited, none
        recorded); ``on_auth_failed(failed, throttled)``: records a refused token, and the
        throttle it starts if it does (run in a worker thread: it takes the controller's
        lock)."""
        self.app = app
        self._tokens = tokens
        self._scrape = scrape_token.encode()  # opens /metrics only; never the dashboard
        self._throttle = throttle
        self._on_auth_failed = on_auth_failed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = str((scope.get("client") or ("?", 0))[0])
        wait_s = self._throttle.retry_after(client) if self._throttle is not None else None
        if wait_s is not None:
            await _too_many(client, wait_s, self._throttle)(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        token = header[7:] if header[:7].lower() == b"bearer " else b""
        path = str(scope["path"])
        agent_api = path.startswith("/v1/agent/")
        ui = is_ui(path)
        if not token and (ui or (scope["method"] in ("GET", "HEAD") and not agent_api)):
            token = cookie_token(scope["headers"])
        scraper = bool(self._scrape) and bool(token) and secrets.compare_digest(token, self._scrape)
        who = SCRAPER if scraper else self._tokens.principal(token)
        if ui and who is None:
            if public_path(path):
                await self.app(scope, receive, send)
            else:
                await login_redirect(scope, receive, send)
            return
        if who is SCRAPER:
            allowed = path == METRICS_PATH
        else:
            allowed = who is not None and (who.is_admin or (who.role == "agent") == agent_api)
        if who is not None and allowed:
            scope.setdefault("state", {})["principal"] = who
            await self.app(scope, receive, send)
            return
        if who is None:
            if self._throttle is not None:
                await self._failed(client, scope, bool(token))
            status, error = 401, "Unauthorized"
            message = (
                "a valid bearer token is required; the CLI reads it from TRAINPOD_TOKEN, "
                "`trainpod login`, or the cluster's state dir (admin.token)"
            )
        elif who.role == "agent":
            status, error = 403, "Forbidden"
            message = "the agents' token reaches only the agent API (/v1/agent/)"
        elif who is SCRAPER:
            status, error = 403, "Forbidden"
            message = f"the scrape token (scrape.token) reaches only {METRICS_PATH}"
        else:
            status, error = 403, "Forbidden"
            message = f"{who.name} may not call the agent API: only node agents may"
        refused = JSONResponse({"error": error, "message": message}, status_code=status)
        await refused(scope, receive, send)

    async def _failed(self, client: str, scope: Scope, had_token: bool) -> None:
        assert self._throttle is not None
        failure = self._throttle.failed(client)
        if not failure.record:
            return
        failed = AuthFailed(
            client=client,
            method=str(scope["method"])[:16],
            path=str(scope["path"])[:MAX_RECORDED_PATH],
            reason="unknown or revoked token" if had_token else "no token",
            unrecorded=failure.unrecorded,
        )
        throttled = None
        if failure.throttles:
            window_s = self._throttle.window_s
            throttled = AuthThrottled(
                client=client,
                failures=self._throttle.max_failures,
                window_s=window_s,
                retry_after_s=window_s,
            )
        await anyio.to_thread.run_sync(self._on_auth_failed, failed, throttled)


def _too_many(client: str, wait_s: float, throttle: AuthThrottle | None) -> JSONResponse:
    assert throttle is not None
    retry = max(1, math.ceil(wait_s))
    message = (
        f"too many failed authentications from {client} ({throttle.max_failures} in "
        f"{throttle.window_s:g} s); retry after {retry} s with a valid token"
    )
    return JSONResponse(
        {"error": "TooManyRequests", "message": message},
        status_code=429,
        headers={"Retry-After": str(retry)},
    )


def caller(request: Request) -> Principal:
    """The principal the call is made as (set by :class:`BearerAuth`)."""
    who = request.state.principal
    assert isinstance(who, Principal)
    return who


Caller = Annotated[Principal, Depends(caller)]


def _user_info(u: UserRow, tokens: list[TokenRow]) -> UserInfo:
    return UserInfo(
        name=u.name,
        team=u.team,
        role=u.role,
        account=u.account,
        source=u.source,
        tokens=[
            TokenInfo(id=t.id, created_at=t.created_at, revoked_at=t.revoked_at) for t in tokens
        ],
    )
