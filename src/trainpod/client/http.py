"""The Python client of the controller's API, used by the CLI, the agent and users.

Every method blocks until the controller answers. Errors come back as trainpod
exceptions: :class:`ControllerUnavailable` when it cannot be reached (retryable), the
matching :class:`Fatal` kind when it refused the request, with its message.
"""

from __future__ import annotations

import ssl
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter

from trainpod.api import models as wire
from trainpod.api.devices import JobEnergy
from trainpod.errors import (
    CertificateRejected,
    Conflict,
    ControllerUnavailable,
    Fatal,
    Forbidden,
    IdempotencyKeyInvalid,
    IdempotencyKeyReused,
    NotFound,
    SpecError,
    StoreUnavailable,
    TrainpodError,
)
from trainpod.spec.job import JobSpec

if TYPE_CHECKING:
    from trainpod.paths import ClusterRecord

_T = TypeVar("_T")

# One adapter per reply type, built once (not on every call, every heartbeat included).
_CLUSTER = TypeAdapter(wire.ClusterInfo)
_NODES = TypeAdapter(list[wire.NodeInfo])
_NODE = TypeAdapter(wire.NodeInfo)
_CHAOS = TypeAdapter(wire.ChaosOrder)
_DOC = TypeAdapter(dict[str, Any])
_ANY: TypeAdapter[Any] = TypeAdapter(Any)
_ENERGY = TypeAdapter(JobEnergy)
_JOB = TypeAdapter(wire.JobInfo)
_JOBS = TypeAdapter(list[wire.JobInfo])
JOBS_PAGE = 500
"""Jobs a listing reads per call (``TrainpodClient.jobs``): ~0.7 MB of JSON."""
_PLAN = TypeAdapter(wire.LaunchPlan)
_LOGS = TypeAdapter(wire.LogChunk)
_EVENTS = TypeAdapter(list[wire.EventInfo])
_ORDERS = TypeAdapter(wire.Orders)
_LEASE = TypeAdapter(wire.AllocationLease)
_SHELL = TypeAdapter(wire.ShellContext)
_STEP = TypeAdapter(wire.StepPlan)
_NONE = TypeAdapter(type(None))
_WHOAMI = TypeAdapter(wire.Whoami)
_USERS = TypeAdapter(list[wire.UserInfo])
_ISSUED = TypeAdapter(wire.IssuedToken)
_IDS = TypeAdapter(list[str])
_ERRORS: dict[str, type[TrainpodError]] = {
    "SpecError": SpecError,
    "Forbidden": Forbidden,
    "NotFound": NotFound,
    "Conflict": Conflict,
    "StoreUnavailable": StoreUnavailable,
    "IdempotencyKeyInvalid": IdempotencyKeyInvalid,
    "IdempotencyKeyReused": IdempotencyKeyReused,
}
IDEMPOTENCY_HEADER = "Idempotency-Key"  # the controller's trainpod.controller.idempotency.HEADER
KEEPALIVE_S = 15.0
"""How long an idle pooled connection is kept: well inside the controller's own keep-alive
(``trainpod.controller.daemon.KEEP_ALIVE_S``), so the client drops it before the server
closes it under a request. httpx's default (5 s) equals uvicorn's, which left a race."""
_DROPPED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
"""A request on a pooled connection the server had closed meanwhile: nothing was answered."""
_IDEMPOTENT = frozenset({"GET", "HEAD"})


def trust_context(ca_file: str | Path | None) -> ssl.SSLContext:
    """The TLS context a client verifies the controller with: ``ca_file`` (a CA, or the
    controller's self-signed certificate) if given, else the system's trust store. Never
    without verification (ADR 0040)."""
    try:
        return ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
    except (OSError, ssl.SSLError) as exc:
        raise Fatal(
            f"cannot load the CA file {ca_file} to verify the controller with ({exc}); "
            "give the PEM CA certificate that signed the controller's certificate "
            "(controller.tls.ca in the cluster spec), readable by this user"
        ) from None


class TrainpodClient:
    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        retry_s: float = 30.0,
        ca_file: str | Path | None = None,
    ) -> None:
        """``retry_s``: how long :meth:`submit` keeps retrying a call the controller did not
        answer (unreachable, the connection dropped, the reply lost), with the same
        idempotency key, before it raises; 0: never retried. An answer (a 503 for a full
        disk included) is never retried: it says what happened. ``ca_file``: what an
        ``https://`` controller is verified against (None: the system's trust store)."""
        self.url = url
        self.retry_s = retry_s
        self.ca_file = ca_file
        https = url.startswith("https://")
        self._http = httpx.Client(
            base_url=url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
            trust_env=False,  # the controller is local or on the cluster network, never proxied
            verify=trust_context(ca_file) if https else True,
            # httpx's own bounds (100 connections, 20 kept idle); only the expiry is ours.
            limits=httpx.Limits(
                max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_S
            ),
        )

    @classmethod
    def for_record(
        cls, record: ClusterRecord, token: str, *, timeout_s: float = 30.0
    ) -> TrainpodClient:
        """A client of the cluster's controller: its URL, verified against its CA."""
        return cls(record.url, token, timeout_s=timeout_s, ca_file=record.ca_file)

    def _unreachable(self, exc: httpx.TransportError) -> TrainpodError:
        """The error for a request that got no answer: a certificate the CA does not vouch
        for is Fatal (retrying will not help), anything else ControllerUnavailable."""
        if _verify_failed(exc):
            trust = self.ca_file or "the system's trust store"
            return CertificateRejected(
                f"certificate verify failed: the controller at {self.url} presented a "
                f"certificate not accepted against {trust} ({exc}); give the CA that signed "
                "it (controller.tls.ca in the cluster spec, or the controller's own certificate "
                "when it is self-signed), and a certificate that names the host in the URL "
                "(controller.advertise)"
            )
        return ControllerUnavailable(
            f"cannot reach the controller at {self.url} ({type(exc).__name__}); "
            "is the cluster running? `trainpod cluster describe` tells, "
            "`trainpod cluster start` restarts it"
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TrainpodClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send once; a read (GET, HEAD) whose connection dropped before any answer
        (:data:`_DROPPED`: a pooled keep-alive connection the server closed as it was
        reused) is sent once more on a fresh one. Nothing else is retried here: a timeout
        may have been answered late, a refused connect means the controller is down, and a
        write is retried only where it carries an idempotency key (:meth:`submit`)."""
        try:
            return self._http.request(method, path, **kwargs)
        except _DROPPED as exc:
            if method not in _IDEMPOTENT:
                raise self._unreachable(exc) from exc
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc

    def _call(
        self,
        method: str,
        path: str,
        reply: TypeAdapter[_T],
        *,
        body: BaseModel | None = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> _T:
        sent = {
            **({"Content-Type": "application/json"} if body is not None else {}),
            **(headers or {}),
        }
        resp = self._request(
            method,
            path,
            content=None if body is None else body.model_dump_json(),
            headers=sent or None,
            params={k: v for k, v in (params or {}).items() if v is not None},
            timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT,
        )
        if resp.status_code >= 400:
            raise _error(resp)
        if resp.status_code == 204:
            return reply.validate_python(None)
        return reply.validate_json(resp.content)

    # -- cluster and nodes ------------------------------------------------------------------
    def metrics(self) -> str:
        """``/metrics`` as Prometheus reads it (the text format)."""
        resp = self._request("GET", "/metrics")
        if resp.status_code >= 400:
            raise _error(resp)
        return resp.text

    def cluster(self) -> wire.ClusterInfo:
        return self._call("GET", "/v1/cluster", _CLUSTER)

    def nodes(self) -> list[wire.NodeInfo]:
        return self._call("GET", "/v1/nodes", _NODES)

    def node_telemetry(self, name: str) -> list[dict[str, Any]] | None:
        """The node's devices with their recent samples (``[{index, name, simulated,
        samples: [{t, utilization_pct, memory_used_bytes, ...}]}]``; a ``{devices: [...]}``
        answer is read the same); None where the controller has no such route (a 404)."""
        resp = self._request("GET", f"/v1/nodes/{name}/telemetry")
        if resp.status_code == 404:
            return None
        if resp.status_code >= 400:
            raise _error(resp)
        body = _ANY.validate_json(resp.content)
        devices = body.get("devices", []) if isinstance(body, dict) else body
        return [d for d in devices if isinstance(d, dict)] if isinstance(devices, list) else []

    def node_action(self, name: str, action: wire.NodeAction) -> wire.NodeInfo:
        return self._call("POST", f"/v1/nodes/{name}/actions", _NODE, body=action)

    def chaos(self, req: wire.ChaosRequest) -> wire.ChaosOrder:
        return self._call("POST", "/v1/chaos", _CHAOS, body=req)

    def energy(self, job_id: int) -> JobEnergy:
        return self._call("GET", f"/v1/jobs/{job_id}/energy", _ENERGY)

    def goodput(self, job_id: int) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/goodput", _DOC)

    # -- jobs -------------------------------------------------------------------------------
    def submit(self, spec: JobSpec, *, idempotency_key: str | None = None) -> wire.JobInfo:
        """Submit a job once, however often the call is retried: it carries an
        ``Idempotency-Key`` (``idempotency_key``, else a fresh UUID) and is sent again with
        the same key for up to ``retry_s`` while the controller does not answer, so a retry
        after a lost reply gets the job the first call made (ADR 0037)."""
        key = idempotency_key or str(uuid.uuid4())
        headers = {IDEMPOTENCY_HEADER: key}
        deadline = time.monotonic() + self.retry_s
        pause_s = 0.25
        while True:
            try:
                return self._call("POST", "/v1/jobs", _JOB, body=spec, headers=headers)
            except ControllerUnavailable:  # no answer: the job may or may not have been made
                if time.monotonic() + pause_s > deadline:
                    raise
            time.sleep(pause_s)  # the controller restarting, or the reply lost: try again
            pause_s = min(pause_s * 2, 4.0)

    def plan(self, spec: JobSpec) -> wire.LaunchPlan:
        return self._call("POST", "/v1/jobs:plan", _PLAN, body=spec)

    def jobs(
        self, *, include_ended: bool = True, limit: int | None = None, page: int | None = JOBS_PAGE
    ) -> list[wire.JobInfo]:
        """The jobs, oldest first (``limit``: the newest ``limit`` of them, in one call).
        Without a limit the list is read ``page`` jobs a call, each page after the last
        one's highest id, so neither side builds a long history in one response; a job
        submitted meanwhile comes in the last page, one that changes state meanwhile as it
        was when its page was read. ``page=None``: the whole list in one call."""
        if limit is not None or page is None:
            params: dict[str, object] = {"all": include_ended, "limit": limit}
            return self._call("GET", "/v1/jobs", _JOBS, params=params)
        if page < 1:
            raise ValueError(f"page must be at least 1, not {page}")
        out: list[wire.JobInfo] = []
        after = 0  # ids start at 1
        while True:
            params = {"all": include_ended, "limit": page, "after": after}
            got = self._call("GET", "/v1/jobs", _JOBS, params=params)
            out.extend(got)
            if len(got) < page:
                return out
            after = got[-1].id

    def job(self, job_id: int) -> wire.JobInfo:
        return self._call("GET", f"/v1/jobs/{job_id}", _JOB)

    def cancel(self, job_id: int) -> wire.JobInfo:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel", _JOB)

    def hold(self, job_id: int, *, release: bool = False) -> wire.JobInfo:
        return self._call("DELETE" if release else "POST", f"/v1/jobs/{job_id}/hold", _JOB)

    def preempt(self, job_id: int, reason: str = "", grace_s: float | None = None) -> wire.JobInfo:
        """Preempt a running job (admins only): notice, grace (default: the cluster spec's),
        then queued again as ``preempted``."""
        body = wire.PreemptRequest(reason=reason, grace_s=grace_s)
        return self._call("POST", f"/v1/jobs/{job_id}/preempt", _JOB, body=body)

    def logs(
        self, job_id: int, *, rank: int = 0, attempt: int | None = None, offset: int = 0
    ) -> wire.LogChunk:
        params = {"rank": rank, "attempt": attempt, "offset": offset}
        return self._call("GET", f"/v1/jobs/{job_id}/logs", _LOGS, params=params)

    def events(
        self,
        *,
        job_id: int | None = None,
        node: str | None = None,
        after: int = 0,
        limit: int | None = None,
    ) -> list[wire.EventInfo]:
        params = {"job": job_id, "node": node, "after": after, "limit": limit}
        return self._call("GET", "/v1/events", _EVENTS, params=params)

    # -- interactive work: trainpod alloc / shell / run -------------------------------------
    def renew_lease(self, job_id: int) -> wire.AllocationLease:
        return self._call("POST", f"/v1/jobs/{job_id}/lease", _LEASE)

    def release(self, job_id: int, reason: str) -> wire.JobInfo:
        return self._call("POST", f"/v1/jobs/{job_id}/release", _JOB, params={"reason": reason})

    def shell_context(
        self, *, node: str | None = None, job_id: int | None = None
    ) -> wire.ShellContext:
        return self._call("GET", "/v1/shell", _SHELL, params={"node": node, "job": job_id})

    def start_step(self, job_id: int, req: wire.StepRequest) -> wire.StepPlan:
        return self._call("POST", f"/v1/jobs/{job_id}/steps", _STEP, body=req)

    def end_step(self, job_id: int, step: int, exit_code: int) -> None:
        end = wire.StepEnd(exit_code=exit_code)
        self._call("POST", f"/v1/jobs/{job_id}/steps/{step}/end", _NONE, body=end)

    # -- users ------------------------------------------------------------------------------
    def whoami(self) -> wire.Whoami:
        return self._call("GET", "/v1/whoami", _WHOAMI)

    def users(self) -> list[wire.UserInfo]:
        return self._call("GET", "/v1/users", _USERS)

    def add_user(self, req: wire.NewToken) -> wire.IssuedToken:
        return self._call("POST", "/v1/users", _ISSUED, body=req)

    def revoke(self, name: str, token_id: str | None = None) -> list[str]:
        body = wire.RevokeRequest(token_id=token_id)
        return self._call("POST", f"/v1/users/{name}/revoke", _IDS, body=body)

    # -- agents -----------------------------------------------------------------------------
    def heartbeat(self, hb: wire.Heartbeat) -> wire.Orders:
        return self._call(
            "POST", "/v1/agent/heartbeat", _ORDERS, body=hb, timeout_s=hb.wait_s + 15.0
        )


def _error(resp: httpx.Response) -> TrainpodError:
    try:
        body = resp.json()
        message = str(body.get("message") or body.get("detail") or body)
        kind = _ERRORS.get(str(body.get("error")), Fatal)
    except ValueError:
        message, kind = resp.text, Fatal
    if resp.status_code == 422 and kind is Fatal:  # FastAPI's own: a body that is no spec
        kind = SpecError
    return kind(f"controller refused the request ({resp.status_code}): {message}")


def _verify_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a failed certificate verification."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return "CERTIFICATE_VERIFY_FAILED" in str(exc)
