"""The HTTP API over a real controller: token auth, status codes, error messages."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from trainpod.api.models import Heartbeat, LifecycleStatus, Orders

from .conftest import Cluster

ADMIN = {"Authorization": "Bearer admin-secret"}
AGENT = {"Authorization": "Bearer agent-secret"}
JOB = {"command": ["python", "train.py"], "nodes": 1, "procs_per_node": 1}


@pytest.fixture
def client(cluster: Cluster) -> Iterator[TestClient]:
    with TestClient(cluster.app()) as client:
        yield client


def heartbeat(cluster: Cluster, node: str = "workers-0") -> dict[str, object]:
    agent = cluster.agents[node]
    hb = Heartbeat(
        node=node,
        agent_id=agent.agent_id,
        agent_pid=agent.agent_pid,
        address="127.0.0.1",
        lifecycle=LifecycleStatus(state="ok"),
    )
    return hb.model_dump(mode="json")


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "admin-secret"},  # not a bearer token
        {"Authorization": "Bearer "},
    ],
)
def test_no_valid_token_is_401(client: TestClient, headers: dict[str, str]) -> None:
    r = client.get("/v1/jobs", headers=headers)
    assert r.status_code == 401
    assert r.json()["error"] == "Unauthorized"
    assert "admin.token" in r.json()["message"]


def test_the_agent_token_only_opens_the_agent_api(client: TestClient, cluster: Cluster) -> None:
    # Known but not allowed there: 403 (not 401), saying what the token is for.
    r = client.get("/v1/jobs", headers=AGENT)
    assert r.status_code == 403 and "only the agent API" in r.json()["message"]
    assert client.post("/v1/jobs", json=JOB, headers=AGENT).status_code == 403
    assert client.get("/v1/nodes", headers=AGENT).status_code == 403
    r = client.post("/v1/agent/heartbeat", json=heartbeat(cluster), headers=AGENT)
    assert r.status_code == 200
    assert Orders.model_validate(r.json()).launch == []
    assert client.post("/v1/agent/heartbeat", json=heartbeat(cluster)).status_code == 401


def test_the_admin_token_opens_everything(client: TestClient, cluster: Cluster) -> None:
    r = client.get("/v1/jobs", headers=ADMIN)
    assert (r.status_code, r.json()) == (200, [])
    assert client.get("/v1/cluster", headers=ADMIN).json()["name"] == cluster.cfg.cluster
    nodes = client.get("/v1/nodes", headers=ADMIN).json()
    assert [n["state"] for n in nodes] == ["idle", "idle"]
    r = client.post("/v1/agent/heartbeat", json=heartbeat(cluster), headers=ADMIN)
    assert r.status_code == 200


def test_the_openapi_schema_requires_a_token(client: TestClient) -> None:
    assert client.get("/v1/openapi.json").status_code == 401
    assert client.get("/v1/docs").status_code == 401
    r = client.get("/v1/openapi.json", headers=ADMIN)
    assert r.status_code == 200
    assert "/v1/jobs" in r.json()["paths"]


def test_submit_query_cancel(client: TestClient, cluster: Cluster) -> None:
    r = client.post("/v1/jobs", json=JOB, headers=ADMIN)
    assert r.status_code == 201
    job = r.json()
    assert (job["state"], job["spec"]["partition"]) == ("queued", "default")
    r = client.get(f"/v1/jobs/{job['id']}", headers=ADMIN)
    assert (r.status_code, r.json()["id"]) == (200, job["id"])
    r = client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    assert (r.status_code, r.json()["state"]) == (200, "cancelled")
    r = client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    assert r.status_code == 409
    assert "already ended" in r.json()["message"]
    events = client.get("/v1/events", params={"job": job["id"]}, headers=ADMIN).json()
    assert [e["kind"] for e in events][:2] == ["job_submitted", "cancel_requested"]


def test_plan_does_not_submit(client: TestClient) -> None:
    r = client.post("/v1/jobs:plan", json={**JOB, "nodes": 2}, headers=ADMIN)
    assert r.status_code == 200
    assert r.json()["nodes"] == ["workers-0", "workers-1"]
    assert client.get("/v1/jobs", headers=ADMIN).json() == []


def test_a_bad_partition_is_400_with_a_clear_message(client: TestClient) -> None:
    r = client.post("/v1/jobs", json={**JOB, "partition": "nope"}, headers=ADMIN)
    assert r.status_code == 400
    body = r.json()
    assert body["error"] == "SpecError"
    assert "partition 'nope' does not exist" in body["message"]
    assert "use one of: default" in body["message"]


def test_too_many_nodes_is_400_naming_the_fix(client: TestClient) -> None:
    r = client.post("/v1/jobs", json={**JOB, "nodes": 5}, headers=ADMIN)
    assert r.status_code == 400
    assert "--nodes 2 or fewer" in r.json()["message"]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"command": []},
        {"command": "python train.py"},
        {"command": ["x"], "nodes": 0},
        {"command": ["x"], "colour": "red"},
        {"command": ["x"], "env": {"RANK": "3"}},
    ],
)
def test_a_malformed_job_is_422(client: TestClient, body: dict[str, object]) -> None:
    r = client.post("/v1/jobs", json=body, headers=ADMIN)
    assert r.status_code == 422
    assert client.get("/v1/jobs", headers=ADMIN).json() == []


def test_an_unknown_job_is_404(client: TestClient) -> None:
    for r in (
        client.get("/v1/jobs/404", headers=ADMIN),
        client.post("/v1/jobs/404/cancel", headers=ADMIN),
        client.get("/v1/jobs/404/logs", headers=ADMIN),
    ):
        assert r.status_code == 404
        assert r.json() == {"error": "NotFound", "message": r.json()["message"]}
        assert "no job 404" in r.json()["message"]


def test_a_heartbeat_from_an_unknown_node_is_404(client: TestClient, cluster: Cluster) -> None:
    body = {**heartbeat(cluster), "node": "ghost-0"}
    r = client.post("/v1/agent/heartbeat", json=body, headers=AGENT)
    assert r.status_code == 404
    assert "not part of cluster" in r.json()["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"node": "workers-0"}', "agent_id"),  # required fields missing
        (b'{"node": "workers-0", "wait_s": 99}', "wait_s"),
        (b"{not json", None),
    ],
)
def test_a_malformed_heartbeat_is_422_as_fastapi_reports_it(
    client: TestClient, body: bytes, field: str | None
) -> None:
    headers = {**AGENT, "Content-Type": "application/json"}
    r = client.post("/v1/agent/heartbeat", content=body, headers=headers)
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert detail and all(e["loc"][0] == "body" and e["msg"] for e in detail)
    if field is not None:
        assert ["body", field] in [e["loc"] for e in detail]


def test_the_heartbeat_is_still_described_in_the_openapi_schema(client: TestClient) -> None:
    paths = client.get("/v1/openapi.json", headers=ADMIN).json()["paths"]
    call = paths["/v1/agent/heartbeat"]["post"]
    assert call["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/Heartbeat"
    )
    assert call["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/Orders"
    )


def test_logs_of_a_job_without_attempts_are_empty(client: TestClient) -> None:
    job = client.post("/v1/jobs", json=JOB, headers=ADMIN).json()
    r = client.get(f"/v1/jobs/{job['id']}/logs", headers=ADMIN)
    assert r.status_code == 200
    assert (r.json()["data"], r.json()["attempt"], r.json()["job_ended"]) == ("", 0, False)


def test_logs_are_read_from_the_rank_log(client: TestClient, cluster: Cluster) -> None:
    job = client.post("/v1/jobs", json=JOB, headers=ADMIN).json()["id"]
    cluster.controller.step()
    path = cluster.cfg.jobs_dir / str(job) / "attempt-1" / "rank-0.log"
    path.parent.mkdir(parents=True)
    path.write_text("step 1\nstep 2\n")
    r = client.get(f"/v1/jobs/{job}/logs", params={"rank": 0}, headers=ADMIN).json()
    assert (r["data"], r["offset"], r["attempt"]) == ("step 1\nstep 2\n", 14, 1)
    r = client.get(f"/v1/jobs/{job}/logs", params={"offset": 7}, headers=ADMIN).json()
    assert r["data"] == "step 2\n"


def test_preempt_by_hand_notice_then_queued_as_preempted(
    client: TestClient, cluster: Cluster
) -> None:
    job = client.post("/v1/jobs", json=JOB, headers=ADMIN).json()
    r = client.post(f"/v1/jobs/{job['id']}/preempt", headers=ADMIN)
    assert r.status_code == 409  # queued: nothing runs to preempt
    assert "only a running job can be preempted" in r.json()["message"]
    attempt = cluster.start(job["id"])
    r = client.post(f"/v1/jobs/{job['id']}/preempt", json={"reason": "maintenance"}, headers=ADMIN)
    assert r.status_code == 200
    assert (r.json()["state"], r.json()["reason"]) == ("stopping", "maintenance")
    again = client.post(f"/v1/jobs/{job['id']}/preempt", headers=ADMIN)
    assert again.status_code == 409 and "already stopping" in again.json()["message"]
    node = cluster.job(job["id"]).attempts[0].nodes[0]
    (kill,) = cluster.agents[node].beat().kill
    assert (kill.attempt_id, kill.notice_signal, kill.reason) == (attempt, "SIGUSR1", "preempted")
    assert kill.notice_grace_s == cluster.cfg.preemption.grace_s
    assert kill.grace_s == cluster.cfg.teardown_grace_s  # SIGTERM -> SIGKILL, after the notice

    cluster.agents[node].exit_all(attempt, code=0)  # saved on the notice and exited
    cluster.agents[node].beat()  # its node freed: the same report's pass places it again
    events = client.get("/v1/events", headers=ADMIN).json()
    kinds = [e["kind"] for e in events]
    assert "job_preempted" in kinds and "fault_detected" not in kinds
    assert "recovery_decision" not in kinds  # requeued: no restart used
    waited = [e["data"] for e in events if e["kind"] == "job_state"]
    assert {"old": "stopping", "new": "preempted", "reason": "preempted: maintenance"} in waited
    info = client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()
    assert info["attempts"][0]["cause"] == "preempted"
    assert (info["state"], len(info["attempts"])) == ("starting", 2)  # like a queued job
    assert client.post("/v1/jobs/404/preempt", headers=ADMIN).status_code == 404


def test_a_preempted_job_waiting_in_the_queue_can_be_cancelled(
    client: TestClient, cluster: Cluster
) -> None:
    first = client.post("/v1/jobs", json={**JOB, "nodes": 2}, headers=ADMIN).json()["id"]
    attempt = cluster.start(first)
    cluster.controller.preempt(first, "make room")
    second = client.post("/v1/jobs", json={**JOB, "nodes": 2}, headers=ADMIN).json()["id"]
    # One node drained: once its ranks end, the preempted job has nowhere to go and waits.
    drain = {"action": "drain", "reason": "keep the job waiting"}
    assert client.post("/v1/nodes/workers-1/actions", json=drain, headers=ADMIN).is_success
    for node in cluster.job(first).attempts[0].nodes:
        cluster.agents[node].kill_ranks(cluster.agents[node].beat())
        cluster.agents[node].beat()
    assert cluster.job(first).state == "preempted"
    r = client.post(f"/v1/jobs/{first}/cancel", headers=ADMIN)
    assert (r.status_code, r.json()["state"]) == (200, "cancelled")
    resume = {"action": "resume", "reason": "done"}
    assert client.post("/v1/nodes/workers-1/actions", json=resume, headers=ADMIN).is_success
    cluster.controller.step()
    assert cluster.job(second).state == "starting" and attempt != cluster.attempt_id(second)


def test_in_process_recovery_is_stored_and_a_bad_mode_is_refused_naming_the_fix(
    client: TestClient,
) -> None:
    body = {**JOB, "auto_resume": True, "recovery": "in-process"}
    r = client.post("/v1/jobs", json=body, headers=ADMIN)
    assert r.status_code == 201, r.text
    shown = client.get(f"/v1/jobs/{r.json()['id']}", headers=ADMIN).json()
    assert shown["spec"]["recovery"] == "in-process"
    r = client.post("/v1/jobs", json={**JOB, "recovery": "in-process"}, headers=ADMIN)
    assert r.status_code == 422
    assert "needs --auto-resume" in r.text
    r = client.post("/v1/jobs", json={**body, "recovery": "hot"}, headers=ADMIN)
    assert r.status_code == 422
    assert "use restart" in r.text
