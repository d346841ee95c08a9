"""The test cluster itself: real slurmctld, four real slurmds, real jobs (scripts/slurm-ci)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.slurm.conftest import SlurmCI


@pytest.fixture
def cluster(slurm: SlurmCI) -> Iterator[SlurmCI]:
    """The session cluster, idle before the test and put back to idle after it."""
    t = slurm.timing
    slurm.wait_idle(timeout_s=t.deadline(t.end_s, t.respond_s))
    yield slurm
    slurm.reset()


def test_all_nodes_idle_in_every_partition(cluster: SlurmCI) -> None:
    nodes = cluster.nodes_json()
    assert sorted(nodes) == ["node1", "node2", "node3", "node4"]
    for node in nodes.values():
        assert (node["state"], node["state_flags"]) == ("idle", [])
        assert node["partitions"] == ["debug", "high", "low"]  # low: preemptible (conftest)
        assert node["cpus"] == 8  # oversubscribed on purpose (SlurmdParameters=config_overrides)


def test_two_node_batch_job_runs_on_two_nodes(cluster: SlurmCI) -> None:
    out = cluster.dir / "two-node.out"
    job_id = cluster.submit(
        "-N2", f"--output={out}", "--wrap", "srun sh -c 'echo $(hostname) $SLURMD_NODENAME'"
    )

    t = cluster.timing
    job = cluster.wait_job(job_id, timeout_s=t.deadline(t.start_s, t.end_s))

    assert (job["job_state"], job["exit_code"], job["node_count"]) == ("COMPLETED", 0, 2)
    lines = sorted(out.read_text().split("\n")[:-1])
    assert len(lines) == 2, lines
    hostnames = [line.split()[0] for line in lines]
    nodenames = [line.split()[1] for line in lines]
    assert len(set(nodenames)) == 2 and set(nodenames) <= set(cluster.nodes)
    if cluster.uts_namespaces:
        assert hostnames == nodenames


def test_drain_and_resume(cluster: SlurmCI) -> None:
    cluster.run("scontrol", "update", "nodename=node2", "state=drain", "reason=maintenance test")

    assert cluster.node_state("node2") == "IDLE+DRAIN"
    assert cluster.node("node2")["reason"] == "maintenance test"

    cluster.run("scontrol", "update", "nodename=node2", "state=resume")
    # Resume marks the node NOT_RESPONDING until slurmctld's ping gets an answer (< 1 s).
    t = cluster.timing
    cluster.wait_node("node2", lambda state: state == "IDLE", timeout_s=t.deadline(t.respond_s))
    assert cluster.node("node2")["reason"] == ""


def test_health_command_can_drain_a_node(cluster: SlurmCI) -> None:
    cluster.set_health_command(
        'if [ "$SLURMD_NODENAME" = node3 ]; then'
        " scontrol update nodename=$SLURMD_NODENAME state=drain reason=health-test; fi"
    )

    # Every slurmd runs the check every HealthCheckInterval.
    t = cluster.timing
    cluster.wait_node(
        "node3", lambda state: "DRAIN" in state.split("+"), timeout_s=t.deadline(t.health_check_s)
    )

    assert cluster.node("node3")["reason"] == "health-test"
    assert all(cluster.node_state(n) == "IDLE" for n in cluster.nodes if n != "node3")


@pytest.mark.timeout(300)
def test_killed_node_goes_down_requeues_its_job_and_comes_back(cluster: SlurmCI) -> None:
    t = cluster.timing
    job_id = cluster.submit("-w", "node4", "--requeue", "--output=/dev/null", "--wrap", "sleep 300")
    cluster.wait_job(job_id, frozenset({"RUNNING"}), timeout_s=t.deadline(t.start_s))

    cluster.kill_node("node4")

    state = cluster.wait_node(
        "node4", lambda s: s.startswith("DOWN"), timeout_s=t.deadline(t.down_s)
    )
    assert "NOT_RESPONDING" in state.split("+")
    assert cluster.node("node4")["reason"] == "Not responding"
    # Slurm requeues the job when it marks the node DOWN; the job is PENDING (BeginTime)
    # until cred_expire + 1 s later, and after that until node4 is back.
    job = cluster.wait_job(job_id, frozenset({"PENDING"}), timeout_s=t.deadline(t.end_s))
    assert job["restart_cnt"] == 1

    cluster.start_node("node4")

    cluster.wait_node(
        "node4", lambda s: s in {"IDLE", "MIXED", "ALLOCATED"}, timeout_s=t.deadline(t.respond_s)
    )
