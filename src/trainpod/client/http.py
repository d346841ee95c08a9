"""The Python client of the controller's API, used by the CLI, the agent and users.

Every method blocks until the controller answers. Errors come back as trainpod
exceptions: :class:`ControllerUnavailable` when it cannot be reached (retryable), the
matching :class:`Fatal` kind when it refused the request, with its message.
"""

from __future__ import annotations

from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter

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
)
from trainpod.errors import (
    Conflict,
    ControllerUnavailable,
    Fatal,
    NotFound,
    SpecError,
    TrainpodError,
)
from trainpod.spec.job import JobSpec

_T = TypeVar("_T")
_ERRORS: dict[str, type[TrainpodError]] = {
    "SpecError": SpecError,
    "NotFound": NotFound,
    "Conflict": Conflict,
}


class TrainpodClient:
    def __init__(self, url: str, token: str, *, timeout_s: float = 30.0) -> None:
        self.url = url
        self._http = httpx.Client(
            base_url=url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
            trust_env=False,  # the controller is local or on the cluster network, never proxied
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TrainpodClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _call(
        self,
        method: str,
        path: str,
        kind: Any,
        *,
        body: BaseModel | None = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        try:
            resp = self._http.request(
                method,
                path,
                content=None if body is None else body.model_dump_json(),
                headers={"Content-Type": "application/json"} if body is not None else None,
                params={k: v for k, v in (params or {}).items() if v is not None},
                timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TransportError as exc:
            raise ControllerUnavailable(
                f"cannot reach the controller at {self.url} ({type(exc).__name__}); "
                "is the cluster running? `trainpod cluster describe` tells, "
                "`trainpod cluster start` restarts it"
            ) from exc
        if resp.status_code >= 400:
            raise _error(resp)
        return TypeAdapter(kind).validate_json(resp.content)

    # -- cluster and nodes ------------------------------------------------------------------
    def cluster(self) -> ClusterInfo:
        return self._call("GET", "/v1/cluster", ClusterInfo)  # type: ignore[no-any-return]

    def nodes(self) -> list[NodeInfo]:
        return self._call("GET", "/v1/nodes", list[NodeInfo])  # type: ignore[no-any-return]

    def node_action(self, name: str, action: NodeAction) -> NodeInfo:
        return self._call("POST", f"/v1/nodes/{name}/actions", NodeInfo, body=action)  # type: ignore[no-any-return]

    def chaos(self, req: ChaosRequest) -> ChaosOrder:
        return self._call("POST", "/v1/chaos", ChaosOrder, body=req)  # type: ignore[no-any-return]

    def goodput(self, job_id: int) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/goodput", dict[str, Any])  # type: ignore[no-any-return]

    # -- jobs -------------------------------------------------------------------------------
    def submit(self, spec: JobSpec) -> JobInfo:
        return self._call("POST", "/v1/jobs", JobInfo, body=spec)  # type: ignore[no-any-return]

    def plan(self, spec: JobSpec) -> LaunchPlan:
        return self._call("POST", "/v1/jobs:plan", LaunchPlan, body=spec)  # type: ignore[no-any-return]

    def jobs(self, *, include_ended: bool = True, limit: int | None = None) -> list[JobInfo]:
        params = {"all": include_ended, "limit": limit}
        return self._call("GET", "/v1/jobs", list[JobInfo], params=params)  # type: ignore[no-any-return]

    def job(self, job_id: int) -> JobInfo:
        return self._call("GET", f"/v1/jobs/{job_id}", JobInfo)  # type: ignore[no-any-return]

    def cancel(self, job_id: int) -> JobInfo:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel", JobInfo)  # type: ignore[no-any-return]

    def logs(
        self, job_id: int, *, rank: int = 0, attempt: int | None = None, offset: int = 0
    ) -> LogChunk:
        params = {"rank": rank, "attempt": attempt, "offset": offset}
        return self._call("GET", f"/v1/jobs/{job_id}/logs", LogChunk, params=params)  # type: ignore[no-any-return]

    def events(
        self,
        *,
        job_id: int | None = None,
        node: str | None = None,
        after: int = 0,
        limit: int | None = None,
    ) -> list[EventInfo]:
        params = {"job": job_id, "node": node, "after": after, "limit": limit}
        return self._call("GET", "/v1/events", list[EventInfo], params=params)  # type: ignore[no-any-return]

    # -- agents -----------------------------------------------------------------------------
    def heartbeat(self, hb: Heartbeat) -> Orders:
        return self._call(  # type: ignore[no-any-return]
            "POST", "/v1/agent/heartbeat", Orders, body=hb, timeout_s=hb.wait_s + 15.0
        )


def _error(resp: httpx.Response) -> TrainpodError:
    try:
        body = resp.json()
        message = str(body.get("message") or body.get("detail") or body)
        kind = _ERRORS.get(str(body.get("error")), Fatal)
    except ValueError:
        message, kind = resp.text, Fatal
    if resp.status_code == 422:
        kind = SpecError
    return kind(f"controller refused the request ({resp.status_code}): {message}")
