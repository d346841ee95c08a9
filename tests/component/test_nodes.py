"""Nodes: registration, lifecycle scripts, liveness, agents that restart."""

from __future__ import annotations

import pytest

from trainpod.errors import NotFound
from trainpod.testing import FakeAgent, FakeGroup, failed_script

from .conftest import Cluster, MakeCluster


def test_declared_nodes_wait_for_their_agents(make_cluster: MakeCluster) -> None:
    c = make_cluster(groups=[FakeGroup("workers", 2), FakeGroup("spares", 1, spare=True)])
    assert c.node_states() == {
        "workers-0": "provisioning",
        "workers-1": "provisioning",
        "spares-0": "provisioning",
    }
    assert [e.node for e in c.events("node_declared")] == ["workers-0", "workers-1", "spares-0"]
    assert c.events("controller_started")[0].data == {"restarted": False}


def test_registration_then_setting_up_then_idle(make_cluster: MakeCluster) -> None:
    c = make_cluster()
    agent = c.agents["workers-0"]
    agent.facts = {"cpus": 8}
    orders = agent.beat(lifecycle="running")
    assert orders.launch == [] and orders.kill == []
    assert orders.heartbeat_interval_s == c.cfg.heartbeat_interval_s
    node = c.node("workers-0")
    assert node.state == "setting_up"
    assert node.agent_pid == agent.agent_pid
    assert node.address == "127.0.0.1"
    assert node.facts["cpus"] == 8
    assert node.facts["lifecycle"]["state"] == "running"
    assert node.last_heartbeat == c.clock.now()

    c.clock.advance(1)
    agent.beat()
    assert c.node("workers-0").state == "idle"
    assert c.node("workers-1").state == "provisioning"  # its agent has not called in
    assert [e.data["restarted"] for e in c.events("agent_registered")] == [False]
    states = [(e.data["old"], e.data["new"]) for e in c.events("node_state", node="workers-0")]
    assert states == [("provisioning", "setting_up"), ("setting_up", "idle")]


def test_an_agent_of_another_cluster_is_refused(cluster: Cluster) -> None:
    with pytest.raises(NotFound, match="another cluster"):
        FakeAgent(cluster.controller, "stranger-0").beat()


def test_a_failed_lifecycle_script_fails_the_node_naming_script_and_tail(
    make_cluster: MakeCluster,
) -> None:
    c = make_cluster()
    agent = c.agents["workers-0"]
    agent.beat(lifecycle="running")
    agent.lifecycle_results = [
        failed_script(
            "install-drivers.sh",
            exit_code=2,
            tail="line 1\nline 2\nE: package nvidia-driver-550 not found\n",
            log_path="/state/nodes/workers-0/lifecycle/00-install-drivers.sh.log",
        )
    ]
    agent.beat(lifecycle="failed")
    node = c.node("workers-0")
    assert node.state == "failed"
    assert "lifecycle script install-drivers.sh exited with code 2" in node.reason
    assert "00-install-drivers.sh.log" in node.reason
    assert node.reason.endswith("E: package nvidia-driver-550 not found")
    event = c.events("node_state", node="workers-0")[-1]
    assert (event.data["new"], event.data["reason"]) == ("failed", node.reason)


def test_a_lifecycle_timeout_is_named(make_cluster: MakeCluster) -> None:
    c = make_cluster()
    agent = c.agents["workers-0"]
    result = failed_script("slow.sh").model_copy(update={"state": "timeout", "duration_s": 60})
    agent.lifecycle_results = [result]
    agent.beat(lifecycle="failed")
    assert "lifecycle script slow.sh timed out after 60.0s" in c.node("workers-0").reason


def test_a_failed_node_is_never_scheduled(make_cluster: MakeCluster) -> None:
    c = make_cluster()
    c.agents["workers-0"].beat(lifecycle="failed")
    c.agents["workers-1"].beat()
    job = c.submit(nodes=1)
    c.controller.step()
    assert c.job(job).attempts[0].nodes == ["workers-1"]
    assert c.node_states()["workers-0"] == "failed"


def test_a_silent_node_is_suspected_then_quarantined(cluster: Cluster) -> None:
    c = cluster
    c.clock.advance(c.cfg.heartbeat_timeout_s)
    c.controller.step()
    assert set(c.node_states().values()) == {"idle"}  # exactly the timeout: not yet

    c.clock.advance(0.5)
    c.agents["workers-1"].beat()
    c.controller.step()
    node = c.node("workers-0")
    assert (node.state, node.reason) == ("quarantined", "node lost: no heartbeat for 10.5s")
    moves = [(e.data["old"], e.data["new"]) for e in c.events("node_state", node="workers-0")]
    assert moves[-2:] == [("idle", "suspect"), ("suspect", "quarantined")]
    assert c.node("workers-1").state == "idle"

    # A node that went silent is not trusted again until it is repaired and deep-checked.
    c.agents["workers-0"].beat()
    assert c.node("workers-0").state == "quarantined"
    assert len(c.events("agent_registered", node="workers-0")) == 1  # the same agent


def test_a_node_whose_agent_never_called_in_is_not_suspect(make_cluster: MakeCluster) -> None:
    c = make_cluster()
    c.clock.advance(1000)
    c.controller.step()
    assert set(c.node_states().values()) == {"provisioning"}


def test_an_agent_leaving_stops_its_node(cluster: Cluster) -> None:
    cluster.agents["workers-0"].beat(leaving=True)
    assert cluster.node("workers-0").state == "stopped"
    cluster.clock.advance(100)
    cluster.agents["workers-1"].beat()
    cluster.controller.step()
    assert cluster.node("workers-0").state == "stopped"  # not suspect: it said goodbye


def test_a_restarted_agent_registers_again(cluster: Cluster) -> None:
    c = cluster
    old = c.agents["workers-0"]
    new = old.restarted()
    assert new.agent_id != old.agent_id
    new.beat(lifecycle="running")
    assert c.node("workers-0").state == "setting_up"
    new.beat()
    assert c.node("workers-0").state == "idle"
    registered = c.events("agent_registered", node="workers-0")
    assert [e.data["restarted"] for e in registered] == [False, True]


def test_a_restarted_agent_whose_lifecycle_fails_at_once_fails_its_idle_node(
    cluster: Cluster,
) -> None:
    """The first beat of a new agent may already carry a failed script (it failed fast)."""
    new = cluster.agents["workers-0"].restarted()
    new.beat(lifecycle="failed")
    assert cluster.node("workers-0").state == "failed"
    assert "lifecycle script setup.sh exited with code 1" in cluster.node("workers-0").reason
