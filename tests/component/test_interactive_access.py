"""Interactive work is its owner's (or an admin's): another user cannot renew, release, run
in or open a shell in someone's allocation or job, nor a shell on a node their job holds;
each refusal is a 403 that says why, and an event."""

from __future__ import annotations

import pytest

from .test_access import OPERATOR, Shared, denials, shared, submit

__all__ = ["shared"]  # the fixture, shared with test_access

HOLD = ["python", "-m", "trainpod.agent.hold"]


@pytest.fixture
def alloc(shared: Shared) -> tuple[Shared, int, str]:
    """alice's running allocation of one node: (the cluster, its id, its node)."""
    job_id = submit(shared, "alice", command=HOLD, interactive=True)
    shared.cluster.start(job_id)
    node = shared.cluster.job(job_id).attempts[-1].nodes[0]
    return shared, job_id, node


def test_another_user_cannot_use_someones_allocation(alloc: tuple[Shared, int, str]) -> None:
    s, job_id, node = alloc
    bob = s.as_("bob")
    refused = [
        s.http.post(f"/v1/jobs/{job_id}/lease", headers=bob),
        s.http.post(f"/v1/jobs/{job_id}/release", headers=bob),
        s.http.post(f"/v1/jobs/{job_id}/steps", json={"command": ["true"]}, headers=bob),
        s.http.post(f"/v1/jobs/{job_id}/steps/1/end", json={"exit_code": 0}, headers=bob),
        s.http.get("/v1/shell", params={"job": job_id}, headers=bob),
        s.http.get("/v1/shell", params={"node": node}, headers=bob),  # the node it holds
    ]
    assert [r.status_code for r in refused] == [403] * 6, [r.text for r in refused]
    assert f"bob may not run in the allocation of job {job_id}" in refused[0].json()["message"]
    assert "belongs to alice" in refused[0].json()["message"]
    assert f"bob may not open a shell in job {job_id}" in refused[4].json()["message"]
    assert [d["data"]["action"] for d in denials(s)] == [
        *["run in the allocation of"] * 4,
        *["open a shell in"] * 2,
    ]
    assert s.http.get(f"/v1/jobs/{job_id}", headers=OPERATOR).json()["state"] == "running"


def test_the_owner_and_an_admin_may(alloc: tuple[Shared, int, str]) -> None:
    s, job_id, node = alloc
    for who in ("alice", "carol"):
        me = s.as_(who)
        assert s.http.post(f"/v1/jobs/{job_id}/lease", headers=me).status_code == 200
        shell = s.http.get("/v1/shell", params={"job": job_id}, headers=me)
        assert shell.status_code == 200 and shell.json()["node"] == node
        step = s.http.post(f"/v1/jobs/{job_id}/steps", json={"command": ["true"]}, headers=me)
        assert step.status_code == 201, step.text
    r = s.http.post(f"/v1/jobs/{job_id}/release", params={"reason": "done"}, headers=s.as_("alice"))
    assert r.status_code == 200 and r.json()["state"] == "stopping"
    assert not denials(s)


def test_a_shell_on_an_idle_node_is_anyones(alloc: tuple[Shared, int, str]) -> None:
    s, _, node = alloc
    idle = next(n for n in s.cluster.agents if n != node)
    r = s.http.get("/v1/shell", params={"node": idle}, headers=s.as_("bob"))
    assert r.status_code == 200 and r.json()["job_id"] is None
