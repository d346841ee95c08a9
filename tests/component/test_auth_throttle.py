"""Failed authentications are limited per client address and recorded (ADR 0032), over the
real HTTP app of a real controller: 10 bad tokens in 60 s, then 429 with Retry-After for
every call from that address (a valid token included), an ``auth_failed`` event per failure
(address, call, why; never the token) and one ``auth_throttled`` event, the counters on
``/metrics``; the window passing lets it in again; loopback is exempt from the throttle, and
its failures are recorded up to the same cap a window, the rest counted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from fastapi.testclient import TestClient

from trainpod.api.app import create_app
from trainpod.api.throttle import AuthThrottle
from trainpod.model.events import AuthFailed, AuthThrottled, parse
from trainpod.testing import FakeClock, make_config

from .conftest import ADMIN_TOKEN, AGENT_TOKEN, Cluster

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BAD = {"Authorization": "Bearer tp_guess"}
E = TypeVar("E", AuthFailed, AuthThrottled)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(make_config(tmp_path), tmp_path / "state.db", FakeClock())
    c.up()
    yield c
    c.close()


def client(cluster: Cluster, throttle: AuthThrottle, host: str) -> TestClient:
    app = create_app(
        cluster.controller,
        admin_token=ADMIN_TOKEN,
        agent_token=AGENT_TOKEN,
        info=cluster.info,
        throttle=throttle,
    )
    return TestClient(app, client=(host, 50000))


def test_ten_failures_a_minute_then_429_recorded_and_counted(cluster: Cluster) -> None:
    clock = [1000.0]
    throttle = AuthThrottle(clock=lambda: clock[0])
    with client(cluster, throttle, "203.0.113.9") as http:
        for _ in range(10):
            r = http.get("/v1/jobs", headers=BAD)
            assert r.status_code == 401, r.text
            clock[0] += 1.0
        for headers in (BAD, ADMIN, {}):
            r = http.get("/v1/jobs", headers=headers)
            assert r.status_code == 429, r.text
            assert r.headers["Retry-After"] == "50"  # at 1010; the first (1000) ages out at 1060
            assert "too many failed authentications from 203.0.113.9" in r.json()["message"]
        [event] = recorded(cluster, AuthThrottled)
        assert event.client == "203.0.113.9" and event.failures == 10
        failed = recorded(cluster, AuthFailed)
        assert [(f.client, f.method, f.path, f.reason, f.unrecorded) for f in failed] == [
            ("203.0.113.9", "GET", "/v1/jobs", "unknown or revoked token", 0)
        ] * 10
        assert not any("tp_guess" in str(e.data) for e in cluster.controller.store.events())

        clock[0] = 1060.5  # the window has moved past the first failure
        assert http.get("/v1/jobs", headers=ADMIN).status_code == 200
        metrics = http.get("/metrics", headers=ADMIN).text
    assert "trainpod_auth_failures_total 10.0" in metrics, metrics
    assert "trainpod_auth_throttled_total 3.0" in metrics


def recorded(cluster: Cluster, kind: type[E]) -> list[E]:
    events = map(parse, cluster.controller.store.events())
    return [e for e in events if isinstance(e, kind)]


def test_another_address_and_loopback_are_not_throttled(cluster: Cluster) -> None:
    throttle = AuthThrottle(max_failures=2)
    with client(cluster, throttle, "203.0.113.9") as http:
        for _ in range(2):
            assert http.get("/v1/jobs", headers=BAD).status_code == 401
        assert http.get("/v1/jobs", headers=ADMIN).status_code == 429
    with client(cluster, throttle, "198.51.100.4") as http:
        assert http.get("/v1/jobs", headers=ADMIN).status_code == 200
    with client(cluster, throttle, "127.0.0.1") as http:  # the agents' and the CLI's
        for _ in range(5):
            assert http.get("/v1/jobs", headers=BAD).status_code == 401
        assert http.get("/v1/jobs", headers=ADMIN).status_code == 200


def test_loopback_failures_are_recorded_up_to_the_cap_and_the_rest_counted(
    cluster: Cluster,
) -> None:
    clock = [1000.0]
    throttle = AuthThrottle(max_failures=3, window_s=60.0, clock=lambda: clock[0])
    with client(cluster, throttle, "127.0.0.1") as http:
        assert http.get("/v1/nodes").status_code == 401  # no token at all
        for _ in range(6):
            assert http.post("/v1/jobs/1/cancel", headers=BAD).status_code == 401
        clock[0] += 61.0  # the window has passed: the next one is recorded with the count
        assert http.get("/v1/jobs", headers=BAD).status_code == 401
        assert http.get("/v1/jobs", headers=ADMIN).status_code == 200  # never throttled
    failed = recorded(cluster, AuthFailed)
    assert [(f.method, f.path, f.reason, f.unrecorded) for f in failed] == [
        ("GET", "/v1/nodes", "no token", 0),
        ("POST", "/v1/jobs/1/cancel", "unknown or revoked token", 0),
        ("POST", "/v1/jobs/1/cancel", "unknown or revoked token", 0),
        ("GET", "/v1/jobs", "unknown or revoked token", 4),
    ]
    assert recorded(cluster, AuthThrottled) == []
    assert throttle.failed_total == 8
