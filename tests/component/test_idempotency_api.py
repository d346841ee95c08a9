"""``POST /v1/jobs`` with an ``Idempotency-Key`` over the real HTTP app of a real controller
(ADR 0037): a replay answers 201 with the first job and makes nothing, another body is a 422
naming the key and what differs, a bad key a 400 naming the limit, keys are per user and
expire after a day."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from trainpod.controller.idempotency import KEY_MAX, KEY_TTL_S
from trainpod.testing import FakeClock, make_config

from .conftest import ADMIN_TOKEN, Cluster, bearer, issue_tokens

KEY = "3f1c8a2e-0b7d-4c1e-9a55-2d7e6f1b9c40"
JOB: dict[str, Any] = {"command": ["python", "train.py"], "nodes": 1, "procs_per_node": 1}


@dataclass
class Api:
    cluster: Cluster
    clock: FakeClock
    http: TestClient
    headers: dict[str, dict[str, str]]

    def submit(self, user: str, body: dict[str, Any], key: str | None = KEY) -> Any:
        extra = {} if key is None else {"Idempotency-Key": key}
        return self.http.post("/v1/jobs", json=body, headers={**self.headers[user], **extra})

    def jobs(self) -> list[int]:
        return [j.id for j in self.cluster.controller.job_infos()]

    def submitted(self) -> int:
        return len(self.cluster.events("job_submitted"))


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    clock = FakeClock()
    cluster = Cluster(make_config(tmp_path), tmp_path / "state.db", clock)
    cluster.up()
    with TestClient(cluster.app()) as http:
        headers = {u: bearer(t) for u, t in issue_tokens(http, "alice", "bob").items()}
        yield Api(cluster, clock, http, {**headers, "admin": bearer(ADMIN_TOKEN)})
    cluster.close()


def test_a_replay_answers_201_with_the_first_job_and_makes_nothing(api: Api) -> None:
    first = api.submit("alice", JOB)
    assert first.status_code == 201, first.text
    assert "Idempotent-Replayed" not in first.headers
    # the same request, its fields in another order and a default written out
    again = api.http.post(
        "/v1/jobs",
        content=json.dumps({"procs_per_node": 1, "auto_resume": False, **JOB}, indent=2),
        headers={
            **api.headers["alice"],
            "Content-Type": "application/json",
            "Idempotency-Key": f'"{KEY}"',  # the draft's form: a Structured Field string
        },
    )
    assert again.status_code == 201, again.text
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert api.jobs() == [first.json()["id"]] and api.submitted() == 1


def test_the_same_key_with_another_body_is_a_422_naming_key_and_difference(api: Api) -> None:
    first = api.submit("alice", JOB).json()["id"]
    api.clock.advance(30)
    r = api.submit("alice", {**JOB, "nodes": 2})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "IdempotencyKeyReused"
    assert KEY in body["message"] and f"job {first}" in body["message"]
    assert "nodes 1 then 2" in body["message"] and "30 s ago" in body["message"]
    assert api.jobs() == [first] and api.submitted() == 1


def test_keys_are_per_user(api: Api) -> None:
    alice = api.submit("alice", JOB)
    bob = api.submit("bob", JOB)
    assert (alice.status_code, bob.status_code) == (201, 201)
    assert "Idempotent-Replayed" not in bob.headers
    assert alice.json()["id"] != bob.json()["id"]
    assert bob.json()["spec"]["user"] == "bob"
    assert api.submit("bob", JOB).json()["id"] == bob.json()["id"]


def test_a_key_is_kept_a_day_then_makes_a_new_job(api: Api) -> None:
    first = api.submit("alice", JOB).json()["id"]
    api.clock.advance(KEY_TTL_S - 1)
    assert api.submit("alice", JOB).json()["id"] == first
    api.clock.advance(2)
    later = api.submit("alice", JOB)
    assert later.status_code == 201 and "Idempotent-Replayed" not in later.headers
    assert later.json()["id"] != first and api.submitted() == 2


@pytest.mark.parametrize("key", ["x" * (KEY_MAX + 1), "two words", "", "caf\u00e9"])
def test_a_bad_key_is_a_400_naming_the_limit(api: Api, key: str) -> None:
    r = api.http.post(
        "/v1/jobs",
        json=JOB,
        headers=[  # as bytes: a non-ASCII key goes as its UTF-8
            *((k.encode(), v.encode()) for k, v in api.headers["alice"].items()),
            (b"Idempotency-Key", key.encode()),
        ],
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "IdempotencyKeyInvalid"
    assert f"1 to {KEY_MAX} visible ASCII characters" in r.json()["message"]
    assert api.jobs() == []


def test_without_a_key_each_call_makes_a_job(api: Api) -> None:
    ids = {api.submit("alice", JOB, key=None).json()["id"] for _ in range(2)}
    assert len(ids) == 2


def test_a_refused_submission_leaves_its_key_free(api: Api) -> None:
    r = api.submit("alice", {**JOB, "partition": "nosuch"})
    assert r.status_code == 400, r.text
    assert api.submit("alice", JOB).status_code == 201  # the key was not taken


def test_the_schema_documents_the_header(api: Api) -> None:
    schema = api.http.get("/v1/openapi.json", headers=api.headers["admin"]).json()
    post = schema["paths"]["/v1/jobs"]["post"]
    (header,) = [p for p in post["parameters"] if p["in"] == "header"]
    assert header["name"] == "Idempotency-Key" and not header.get("required")
    assert f"1 to {KEY_MAX}" in header["description"] and "24 h" in header["description"]
    assert {"201", "400", "422"} <= set(post["responses"])
    assert "Idempotent-Replayed" in post["responses"]["201"]["headers"]
