"""Failed authentications are limited per client address and recorded (ADR 0032), over the
real HTTP app of a real controller: 10 bad tokens in 60 s, then 429 with Retry-After for
every call from that address (a valid token included), one ``auth_throttled`` event, the
counters on ``/metrics``; the window passing lets it in again; loopback is exempt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from trainpod.api.app import create_app
from trainpod.api.throttle import AuthThrottle
from trainpod.model.events import AuthThrottled, parse
from trainpod.testing import FakeClock, make_config

from .conftest import ADMIN_TOKEN, AGENT_TOKEN, Cluster

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BAD = {"Authorization": "Bearer tp_guess"}


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
        [event] = [
            parse(e) for e in cluster.controller.store.events() if e.kind == AuthThrottled.kind
        ]
        assert isinstance(event, AuthThrottled)
        assert event.client == "203.0.113.9" and event.failures == 10

        clock[0] = 1060.5  # the window has moved past the first failure
        assert http.get("/v1/jobs", headers=ADMIN).status_code == 200
        metrics = http.get("/metrics", headers=ADMIN).text
    assert "trainpod_auth_failures_total 10.0" in metrics, metrics
    assert "trainpod_auth_throttled_total 3.0" in metrics


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
