"""Users, tokens and the access policy over the real HTTP API of a real controller.

Two users of two teams and an admin: nobody can touch another's job, a forged owner is
ignored, every refusal is a 403 that says why and an event, tokens are stored hashed.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from trainpod.controller.access import HIDDEN
from trainpod.controller.views import FROZEN_AFTER_S
from trainpod.spec.sharing import PriorityClassSpec, TeamSpec, UserSpec
from trainpod.store.secrets import JobSecrets
from trainpod.testing import FakeClock, make_config

from .conftest import Cluster, bearer, issue_tokens

OPERATOR = {"Authorization": "Bearer admin-secret"}
AGENT = {"Authorization": "Bearer agent-secret"}


def job(**kw: object) -> dict[str, object]:
    return {"command": ["python", "train.py"], "nodes": 1, "procs_per_node": 1, **kw}


@dataclasses.dataclass
class Shared:
    cluster: Cluster
    http: TestClient
    tokens: dict[str, dict[str, str]]  # user -> headers

    def as_(self, user: str) -> dict[str, str]:
        return self.tokens[user]


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[Shared]:
    cfg = dataclasses.replace(
        make_config(tmp_path),
        priority_classes=(
            PriorityClassSpec(name="high", value=1000, preemptible=False),
            PriorityClassSpec(name="normal", value=100, default=True),
            PriorityClassSpec(name="low", value=10),
        ),
        teams=(
            TeamSpec(name="vision", quota={"default": 1}, default_priority_class="low"),
            TeamSpec(name="nlp", quota={"default": 1}),
        ),
        users=(
            UserSpec(name="alice", team="vision"),
            UserSpec(name="bob", team="nlp"),
            UserSpec(name="carol", role="admin"),
        ),
        operator="root",
    )
    cluster = Cluster(cfg, tmp_path / "state.db", FakeClock())
    cluster.up()
    with TestClient(cluster.app()) as http:
        tokens = {u: bearer(t) for u, t in issue_tokens(http, "alice", "bob", "carol").items()}
        yield Shared(cluster, http, tokens)
    cluster.close()


def submit(s: Shared, caller: str, **kw: object) -> int:
    r = s.http.post("/v1/jobs", json=job(**kw), headers=s.as_(caller))
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def denials(s: Shared) -> list[dict[str, Any]]:
    events = s.http.get("/v1/events", headers=OPERATOR).json()
    return [e for e in events if e["kind"] == "access_denied"]


def test_the_owner_is_the_caller_never_the_name_the_request_sends(s: Shared) -> None:
    job_id = submit(s, "alice", user="bob")  # forged
    info = s.http.get(f"/v1/jobs/{job_id}", headers=s.as_("bob")).json()
    assert info["spec"]["user"] == "alice" and info["spec"]["team"] == "vision"
    submitted = next(
        e for e in s.http.get("/v1/events", headers=OPERATOR).json() if e["kind"] == "job_submitted"
    )
    assert submitted["data"]["user"] == "alice"
    assert s.http.get("/v1/whoami", headers=s.as_("bob")).json()["name"] == "bob"


def test_a_user_cannot_cancel_another_users_job_and_the_refusal_is_recorded(s: Shared) -> None:
    job_id = submit(s, "alice")
    r = s.http.post(f"/v1/jobs/{job_id}/cancel", headers=s.as_("bob"))
    assert r.status_code == 403
    assert r.json()["error"] == "Forbidden"
    message = r.json()["message"]
    assert f"bob may not cancel job {job_id}" in message and "belongs to alice" in message
    assert s.http.get(f"/v1/jobs/{job_id}", headers=OPERATOR).json()["state"] != "cancelled"
    [denied] = denials(s)
    assert denied["data"]["user"] == "bob" and denied["job_id"] == job_id
    assert denied["data"]["action"] == "cancel"
    # Its owner may, and so may an admin (another job).
    assert s.http.post(f"/v1/jobs/{job_id}/cancel", headers=s.as_("alice")).status_code == 200
    other = submit(s, "bob")
    assert s.http.post(f"/v1/jobs/{other}/cancel", headers=s.as_("carol")).status_code == 200


def test_everybody_sees_the_queue_and_public_logs_but_not_private_ones(s: Shared) -> None:
    public = submit(s, "alice")
    private = submit(s, "alice", private=True)
    jobs = s.http.get("/v1/jobs", headers=s.as_("bob")).json()
    assert {j["id"] for j in jobs} == {public, private}
    assert s.http.get(f"/v1/jobs/{public}/logs", headers=s.as_("bob")).status_code == 200
    r = s.http.get(f"/v1/jobs/{private}/logs", headers=s.as_("bob"))
    assert r.status_code == 403 and "read the logs of" in r.json()["message"]
    assert s.http.get(f"/v1/jobs/{private}/logs", headers=s.as_("alice")).status_code == 200
    assert s.http.get(f"/v1/jobs/{private}/logs", headers=s.as_("carol")).status_code == 200


def test_admin_operations_are_refused_to_users(s: Shared) -> None:
    node = s.http.get("/v1/nodes", headers=s.as_("alice")).json()[0]["name"]
    r = s.http.post(
        f"/v1/nodes/{node}/actions", json={"action": "drain", "reason": "x"}, headers=s.as_("alice")
    )
    assert r.status_code == 403 and "only an admin may" in r.json()["message"]
    r = s.http.post("/v1/chaos", json={"node": node, "fault": "xid79"}, headers=s.as_("alice"))
    assert r.status_code == 403
    assert s.http.get("/v1/users", headers=s.as_("bob")).status_code == 403
    r = s.http.post("/v1/users", json={"name": "mallory"}, headers=s.as_("bob"))
    assert r.status_code == 403
    assert [d["data"]["action"] for d in denials(s)] == [
        "manage nodes",
        "inject faults",
        "manage users",
        "manage users",
    ]
    # An admin user may.
    r = s.http.post(
        f"/v1/nodes/{node}/actions", json={"action": "drain", "reason": "x"}, headers=s.as_("carol")
    )
    assert r.status_code == 200


def test_user_tokens_do_not_reach_the_agent_api_nor_agent_tokens_the_rest(s: Shared) -> None:
    r = s.http.post("/v1/agent/heartbeat", json={}, headers=s.as_("alice"))
    assert r.status_code == 403 and "only node agents" in r.json()["message"]
    assert s.http.get("/v1/jobs", headers=AGENT).status_code == 403


def test_tokens_are_stored_hashed_listed_and_revoked(s: Shared, tmp_path: Path) -> None:
    secret = s.as_("alice")["Authorization"].removeprefix("Bearer ")
    with sqlite3.connect(tmp_path / "state.db") as db:
        dump = "\n".join(db.iterdump())
    assert secret not in dump
    users = {u["name"]: u for u in s.http.get("/v1/users", headers=OPERATOR).json()}
    assert users["alice"]["team"] == "vision" and users["alice"]["source"] == "spec"
    assert len(users["alice"]["tokens"]) == 1 and "token" not in users["alice"]["tokens"][0]
    r = s.http.post("/v1/users/alice/revoke", json={}, headers=OPERATOR)
    assert r.status_code == 200 and r.json() == [users["alice"]["tokens"][0]["id"]]
    assert s.http.get("/v1/jobs", headers=s.as_("alice")).status_code == 401
    assert s.http.get("/v1/jobs", headers=s.as_("bob")).status_code == 200
    kinds = [e["kind"] for e in s.http.get("/v1/events", headers=OPERATOR).json()]
    assert kinds.count("token_issued") == 3 and kinds.count("tokens_revoked") == 1


def test_users_add_refuses_unknown_teams_and_needs_a_team_once_teams_exist(s: Shared) -> None:
    r = s.http.post("/v1/users", json={"name": "dave", "team": "robots"}, headers=OPERATOR)
    assert r.status_code == 404 and "team 'robots' is not in the cluster spec" in r.text
    r = s.http.post("/v1/users", json={"name": "dave"}, headers=OPERATOR)
    assert r.status_code == 409 and "give --team" in r.text
    r = s.http.post("/v1/users", json={"name": "Dave!", "team": "nlp"}, headers=OPERATOR)
    assert r.status_code == 422
    r = s.http.post("/v1/users", json={"name": "dave", "team": "nlp"}, headers=OPERATOR)
    assert r.status_code == 201 and r.json()["user"]["source"] == "cli"
    dave = {"Authorization": f"Bearer {r.json()['token']}"}
    assert s.http.get("/v1/whoami", headers=dave).json()["team"] == "nlp"


def test_priority_classes_resolve_from_the_team_and_unknown_ones_are_refused(s: Shared) -> None:
    mine = submit(s, "alice")
    theirs = submit(s, "bob")
    spec = {j: s.http.get(f"/v1/jobs/{j}", headers=OPERATOR).json()["spec"] for j in (mine, theirs)}
    assert spec[mine]["priority_class"] == "low"  # vision's default
    assert spec[theirs]["priority_class"] == "normal"  # the cluster's
    r = s.http.post("/v1/jobs", json=job(priority_class="urgent"), headers=s.as_("bob"))
    assert r.status_code == 400
    assert "'urgent' is not a priority class" in r.json()["message"]
    assert "high, normal, low" in r.json()["message"]


@pytest.fixture
def s(shared: Shared) -> Shared:
    return shared


def test_hold_and_release_over_the_api_are_the_owners(s: Shared) -> None:
    job_id = submit(s, "alice")
    r = s.http.post(f"/v1/jobs/{job_id}/hold", headers=s.as_("bob"))
    assert r.status_code == 403 and "hold or release" in r.json()["message"]
    r = s.http.post(f"/v1/jobs/{job_id}/hold", headers=s.as_("alice"))
    assert r.status_code == 200 and r.json()["reason"].startswith("held by alice")
    r = s.http.delete(f"/v1/jobs/{job_id}/hold", headers=s.as_("alice"))
    assert r.status_code == 200 and not r.json()["reason"].startswith("held")


def test_env_values_are_the_owners_and_admins_others_see_the_keys(s: Shared) -> None:
    secret = {"HF_TOKEN": "hf_secret", "SEED": "7"}
    live = submit(s, "alice", env=secret, nodes=2)  # 2 nodes of 1: stays queued
    done = submit(s, "alice", env=secret)
    s.http.post(f"/v1/jobs/{done}/cancel", headers=s.as_("alice"))
    hidden = {"HF_TOKEN": HIDDEN, "SEED": HIDDEN}

    def envs(caller: dict[str, str]) -> dict[int, dict[str, str]]:
        jobs = s.http.get("/v1/jobs", headers=caller).json()
        return {j["id"]: j["spec"]["env"] for j in jobs}

    for _ in range(3):  # the third time the ended job comes from the views' cache
        assert envs(s.as_("bob")) == {live: hidden, done: hidden}
        for who in (s.as_("alice"), s.as_("carol"), OPERATOR):
            assert envs(who) == {live: secret, done: secret}
        for job_id in (live, done):
            one = s.http.get(f"/v1/jobs/{job_id}", headers=s.as_("bob")).json()
            assert one["spec"]["env"] == hidden and one["spec"]["user"] == "alice"
            mine = s.http.get(f"/v1/jobs/{job_id}", headers=s.as_("alice")).json()
            assert mine["spec"]["env"] == secret
        s.cluster.clock.advance(FROZEN_AFTER_S + 1)
    assert "hf_secret" not in s.http.get("/v1/events", headers=s.as_("bob")).text
    # Not a refusal: nothing is recorded.
    assert denials(s) == []


def test_secret_env_values_reach_the_launch_order_only(s: Shared) -> None:
    """ADR 0032: the values go apart; views show the names masked to the owner and admins,
    nothing to others; the launch order (the agent's) has them; the job's end forgets them."""
    job_id = submit(s, "alice", secret_env={"HF_TOKEN": "hf_canary"}, env={"SEED": "7"})
    masked = {"HF_TOKEN": "***"}
    for who in (s.as_("alice"), s.as_("carol"), OPERATOR):
        assert s.http.get(f"/v1/jobs/{job_id}", headers=who).json()["spec"]["secret_env"] == masked
    theirs = s.http.get(f"/v1/jobs/{job_id}", headers=s.as_("bob")).json()["spec"]
    assert theirs["secret_env"] == {} and theirs["env"] == {"SEED": HIDDEN}
    plan = s.http.post("/v1/jobs:plan", json=job(secret_env={"K": "v1"}), headers=s.as_("alice"))
    assert plan.status_code == 200 and "v1" not in plan.text, plan.text

    s.cluster.controller.step()
    [(node, orders)] = [(n, o) for n, o in s.cluster.beat().items() if o.launch]
    [launch] = orders.launch
    assert launch.env["HF_TOKEN"] == "hf_canary" and launch.env["SEED"] == "7"
    for route in ("/v1/events", "/v1/jobs"):
        assert "hf_canary" not in s.http.get(route, headers=OPERATOR).text
    agent = s.cluster.agents[node]
    agent.start_ranks(orders)
    agent.beat()
    agent.exit_all(launch.attempt_id, code=0)
    agent.beat()
    s.cluster.controller.step()
    assert s.http.get(f"/v1/jobs/{job_id}", headers=OPERATOR).json()["state"] == "completed"
    assert JobSecrets(s.cluster.controller.store).get(job_id) == {}  # forgotten at its end


def test_a_secret_also_given_as_env_or_a_contract_variable_is_refused(s: Shared) -> None:
    r = s.http.post(
        "/v1/jobs", json=job(env={"K": "a"}, secret_env={"K": "b"}), headers=s.as_("alice")
    )
    assert r.status_code == 422 and "K given both with --env and --secret-env" in r.text
    r = s.http.post("/v1/jobs", json=job(secret_env={"RANK": "3"}), headers=s.as_("alice"))
    assert r.status_code == 422 and "--secret-env may not set RANK" in r.text
