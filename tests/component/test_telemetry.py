"""Device telemetry through the controller: the heartbeat's samples into the node's rings
(served at /v1/nodes/{name}/telemetry), and energy per job attempt, kept across a restart.
The devices are SIMULATED (the agent's real sampler over its simulated reader)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from trainpod.agent.devices import DeviceTelemetry, SimulatedReader
from trainpod.api.app import create_app
from trainpod.api.models import ClusterInfo
from trainpod.store.energy import IDLE_JOB, Energy

from .conftest import Cluster, MakeCluster

ADMIN = {"Authorization": "Bearer admin-secret"}
FIELDS = "t utilization_pct memory_used_bytes memory_total_bytes power_w temperature_c energy_j"
FIELDS_LIST = FIELDS.split()


@pytest.fixture
def cluster(make_cluster: MakeCluster) -> Cluster:
    c = make_cluster()
    for agent in c.agents.values():
        agent.devices = DeviceTelemetry(
            SimulatedReader(2, None, clock=c.clock.now), clock=c.clock.now
        )
    c.up()
    return c


def client_for(cluster: Cluster) -> TestClient:
    def info() -> ClusterInfo:
        raise AssertionError("not used")

    app = create_app(
        cluster.controller, admin_token="admin-secret", agent_token="agent-secret", info=info
    )
    return TestClient(app)


@pytest.fixture
def client(cluster: Cluster) -> Iterator[TestClient]:
    with client_for(cluster) as client:
        yield client


def run_for(cluster: Cluster, seconds: int) -> None:
    for _ in range(seconds):
        cluster.clock.advance(1.0)
        cluster.beat()
        cluster.controller.step()


def test_a_nodes_devices_show_their_recent_samples(cluster: Cluster, client: TestClient) -> None:
    job = cluster.submit(nodes=1, procs=2)
    cluster.start(job)
    run_for(cluster, 5)
    node = cluster.job(job).attempts[0].nodes[0]
    r = client.get(f"/v1/nodes/{node}/telemetry", headers=ADMIN)
    assert r.status_code == 200
    devices = r.json()
    assert [d["index"] for d in devices] == [0, 1]
    assert all(d["simulated"] for d in devices)
    for d in devices:
        samples = d["samples"]
        assert len(samples) >= 5
        assert set(samples[0]) == set(FIELDS_LIST)
        assert samples[-1]["utilization_pct"] > 80  # its ranks run there
        assert samples[-1]["energy_j"] > samples[0]["energy_j"]
    other = next(n for n in cluster.agents if n != node)
    idle = client.get(f"/v1/nodes/{other}/telemetry", headers=ADMIN).json()
    assert {s["utilization_pct"] for d in idle for s in d["samples"]} == {0.0}
    r = client.get("/v1/nodes/nope/telemetry", headers=ADMIN)
    assert r.status_code == 404 and "nope" in r.json()["message"]


def test_a_node_that_goes_away_loses_its_rings(cluster: Cluster) -> None:
    run_for(cluster, 2)
    assert cluster.controller.node_telemetry("workers-1")
    cluster.agents["workers-1"].beat(leaving=True)
    assert cluster.controller.node_telemetry("workers-1") == []


def test_energy_goes_to_the_attempt_holding_the_node_and_survives_a_restart(
    cluster: Cluster,
) -> None:
    job = cluster.submit(nodes=1, procs=2)
    cluster.start(job)
    run_for(cluster, 10)
    cluster.clock.advance(10.0)
    cluster.controller.step()  # a flush is due
    with cluster.controller.store.transaction():
        rows = Energy(cluster.controller.store).of_job(job)
        idle = Energy(cluster.controller.store).per_job()[IDLE_JOB]
    (row,) = rows
    assert (row.attempt, row.node, row.simulated) == (
        1,
        cluster.job(job).attempts[0].nodes[0],
        True,
    )
    # two busy simulated devices for about 10 s: well above two idle ones for as long
    assert row.joules > 2 * 10 * 500
    assert 0 < idle.joules < row.joules
    restarted = cluster.restart_controller()
    with restarted.store.transaction():
        assert Energy(restarted.store).of_job(job) == rows
    with client_for(cluster) as client:
        e = client.get(f"/v1/jobs/{job}/energy", headers=ADMIN).json()
        assert e["joules"] == pytest.approx(row.joules)
        assert e["kwh"] == pytest.approx(row.joules / 3.6e6)
        assert e["co2e_kg"] == pytest.approx(e["kwh"] * 475.0 / 1000)  # world average
        assert e["simulated"] and "world average" in e["intensity_source"]
        assert [(p["attempt"], p["node"]) for p in e["parts"]] == [(1, row.node)]
        summary = client.get("/v1/energy", headers=ADMIN).json()
        assert summary["teams"]["none"]["joules"] == pytest.approx(row.joules)
        assert summary["users"][cluster.job(job).spec.user]["joules"] == pytest.approx(row.joules)
        total = summary["cluster"]["joules"]
        assert total == pytest.approx(row.joules + summary["idle"]["joules"])
        assert client.get("/v1/jobs/999/energy", headers=ADMIN).status_code == 404
