"""A lost node's rank is replaced in process by the spare's, which takes its state from a
healthy peer (ADR 0035): a real local cluster of 2 workers and 1 hot spare, 2 nodes x 1 Gloo
rank on CPU, the node lost with chaos ``kill-agent`` (its ranks first, then its agent).

The healthy rank never restarts; the replacement's state when it joined equals the healthy
rank's bit for bit; the job ends with the undisturbed run's model. A job whose state is
sharded (``replicated=False``) cannot be given a peer's copy: it falls back to a full
restart, and the events say why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Cluster
from trainpod.api.models import ChaosRequest, JobInfo
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
WORKER = Path(__file__).parent / "workers" / "elastic_dp.py"
STEPS = 120


def _results(out: Path) -> dict[int, dict[str, Any]]:
    return {r: json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)}


def _start(cluster: Cluster, out: Path, *extra: str) -> tuple[JobInfo, dict[int, int | None]]:
    """An opted-in job past step 5 on workers-0 and workers-1, and its ranks' pids."""
    out.mkdir()
    argv = ["python", str(WORKER), "--steps", str(STEPS), "--out", str(out)]
    argv += ["--mark-at", "5", "--step-sleep", "0.1", "--wait-s", "120", *extra]
    job = cluster.submit(argv, nodes=2, procs_per_node=1, auto_resume=True, recovery="in-process")
    wait_until(
        lambda: all((out / f"at-5-rank-{r}").exists() for r in range(2)),
        timeout_s=90,
        what="every rank past step 5",
    )
    (attempt,) = cluster.client.job(job.id).attempts
    assert attempt.nodes == ["workers-0", "workers-1"]
    return job, {r.rank: r.pid for r in attempt.ranks}


@pytest.mark.timeout(300)
def test_a_lost_node_is_replaced_in_process_by_the_spare(cluster: Cluster, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    reference.mkdir()
    argv = ["python", str(WORKER), "--steps", str(STEPS), "--out", str(reference)]
    done = cluster.wait_job(cluster.submit(argv, nodes=2, procs_per_node=1).id, timeout_s=120)
    assert done.state == "completed", cluster.describe(done)
    undisturbed = _results(reference)
    cluster.wait_idle()

    out = tmp_path / "out"
    job, pids = _start(cluster, out)
    # 115 steps of 0.1 s are left: the node is lost long before the attempt could end
    cluster.client.chaos(ChaosRequest(node="workers-1", fault="kill-agent"))
    done = cluster.wait_job(job.id, timeout_s=180)
    assert done.state == "completed", cluster.describe(done)
    (same,) = done.attempts  # the attempt was kept: its lost node's place went to the spare
    assert same.nodes == ["workers-0", "spares-0"]
    assert (same.generation, same.generation_confirmed) == (1, True)
    assert {r.rank: r.node for r in same.ranks} == {0: "workers-0", 1: "spares-0"}
    assert all(r.exit_code == 0 for r in same.ranks)

    events = cluster.client.events(job_id=job.id)
    kinds = [e.kind for e in events]
    assert "recovery_decision" not in kinds and "fault_detected" not in kinds
    (started,) = [e for e in events if e.kind == "in_process_recovery_started"]
    assert (started.data["replaced"], started.data["moved"]) == ([1], {"workers-1": "spares-0"})
    (recovered,) = [e for e in events if e.kind == "in_process_recovery_done"]
    assert recovered.data["generation"] == 1 and recovered.ts > started.ts

    results = _results(out)
    assert results[0]["pid"] == pids[0]  # the healthy rank never restarted
    assert results[1]["pid"] != pids[1] and results[1]["node"] == "spares-0"
    assert [r.data["generation"] for r in events if r.kind == "in_process_recovery_done"] == [1]
    (joined,) = results[1]["recoveries"]
    assert (joined["cause"], joined["source"]) == ("replacement", 0)
    # the spare's state when it joined was the healthy rank's, bit for bit
    assert results[1]["group_hashes"] == [results[0]["group_hashes"][-1]]
    assert {r["steps"] for r in results.values()} == {STEPS}
    assert {r["generation"] for r in results.values()} == {1}
    for r in range(2):  # the model of the undisturbed run, bit for bit
        assert results[r]["final_loss"] == undisturbed[r]["final_loss"]
        assert results[r]["params"] == undisturbed[r]["params"]


@pytest.mark.timeout(300)
def test_a_sharded_job_falls_back_to_a_full_restart(cluster: Cluster, tmp_path: Path) -> None:
    job, _ = _start(cluster, tmp_path / "out", "--sharded")
    cluster.client.chaos(ChaosRequest(node="workers-1", fault="kill-agent"))
    done = cluster.wait_job(job.id, timeout_s=180)
    assert done.state == "completed", cluster.describe(done)
    assert [a.nodes for a in done.attempts] == [
        ["workers-0", "spares-0"],  # the first attempt, its lost node's place given in process
        ["workers-0", "spares-0"],
    ]
    events = cluster.client.events(job_id=job.id)
    abandoned = [e.data["reason"] for e in events if e.kind == "in_process_recovery_abandoned"]
    assert len(abandoned) == 1 and "the state is sharded (replicated=False)" in abandoned[0]
    assert "75: it could not re-join its group" in abandoned[0]
    assert [e.data["action"] for e in events if e.kind == "recovery_decision"] == ["restart"]
    assert not [e for e in events if e.kind == "in_process_recovery_done"]


@pytest.mark.timeout(300)
def test_a_node_with_a_gpu_fault_is_replaced_in_process_while_its_agent_lives(
    cluster: Cluster, tmp_path: Path
) -> None:
    """An XID (simulated: no GPU here) quarantines workers-1 with its agent alive: the agent
    kills its rank, the spare's rank joins the same attempt with the healthy peer's state."""
    out = tmp_path / "out"
    job, pids = _start(cluster, out)
    cluster.client.chaos(ChaosRequest(node="workers-1", fault="xid79"))
    done = cluster.wait_job(job.id, timeout_s=180)
    assert done.state == "completed", cluster.describe(done)
    (same,) = done.attempts
    assert same.nodes == ["workers-0", "spares-0"]
    assert {r.rank: r.node for r in same.ranks} == {0: "workers-0", 1: "spares-0"}
    assert all(r.exit_code == 0 for r in same.ranks)
    events = cluster.client.events(job_id=job.id)
    (lost,) = [e for e in events if e.kind == "rank_lost"]
    assert lost.node == "workers-1" and lost.data["reason"].startswith("node taken out: gpu:")
    (started,) = [e for e in events if e.kind == "in_process_recovery_started"]
    assert started.data["moved"] == {"workers-1": "spares-0"}
    assert "recovery_decision" not in [e.kind for e in events]
    results = _results(out)
    assert results[0]["pid"] == pids[0]  # the healthy rank never restarted
    assert results[1]["node"] == "spares-0"
    assert results[1]["group_hashes"] == [results[0]["group_hashes"][-1]]
    assert {r["steps"] for r in results.values()} == {STEPS}
    nodes = {n.name: n.state for n in cluster.client.nodes()}
    assert nodes["workers-1"] in ("quarantined", "repairing", "idle")  # repaired after
