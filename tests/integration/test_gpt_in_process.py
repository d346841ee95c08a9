"""The GPT example with ``--recovery in-process`` on a real local cluster (2 nodes x 1 Gloo
rank, CPU): a killed rank is started again in the same attempt, the healthy rank keeps its
process and its Checkpointer (rebound to the new group), the replacement takes its state
from the healthy rank, checkpoints go on being committed, and the run ends with the loss of
an undisturbed run, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from trainpod.api.models import ChaosRequest
from trainpod.ckpt.tiers import step_name
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration

GPT = Path(__file__).parents[2] / "examples" / "gpt" / "train.py"
STEPS = 200
ARGS = ["--steps", str(STEPS), "--ckpt-every", "5", "--eval-every", "0", "--log-every", "10"]


def _committed(durable: Path) -> list[int]:
    return sorted(int(m.parent.name.split("-")[1]) for m in durable.rglob("step-*/manifest.json"))


@pytest.mark.timeout(480)
def test_gpt_survives_a_killed_rank_in_process(cluster: Cluster, tmp_path: Path) -> None:
    ref = tmp_path / "reference"
    job = cluster.submit(
        ["python", str(GPT), *ARGS, "--ckpt-dir", str(ref)], nodes=2, procs_per_node=1
    )
    done = cluster.wait_job(job.id, timeout_s=150)
    assert done.state == "completed", cluster.describe(done)
    undisturbed = json.loads((ref / "summary.json").read_text())
    cluster.wait_idle()

    durable = tmp_path / "ckpt"
    argv = ["python", str(GPT), *ARGS, "--ckpt-dir", str(durable)]
    job = cluster.submit(argv, nodes=2, procs_per_node=1, auto_resume=True, recovery="in-process")
    wait_until(lambda: _committed(durable), timeout_s=90, what="a first committed checkpoint")
    (attempt,) = cluster.client.job(job.id).attempts
    pids = {r.rank: r.pid for r in attempt.ranks}
    cluster.client.chaos(ChaosRequest(node="workers-1", fault="kill-worker", rank=1))
    wait_until(
        lambda: any(
            e.kind == "in_process_recovery_done" for e in cluster.client.events(job_id=job.id)
        ),
        timeout_s=60,
        what="the in-process recovery of the killed rank",
    )
    after = _committed(durable)[-1]
    wait_until(
        lambda: _committed(durable)[-1] > after, timeout_s=60, what="a save after the recovery"
    )
    # Its node lost now: the spare's rank joins the same attempt with rank 0's state.
    cluster.client.chaos(ChaosRequest(node="workers-1", fault="kill-agent"))
    done = cluster.wait_job(job.id, timeout_s=200)
    assert done.state == "completed", cluster.describe(done)
    events = cluster.client.events(job_id=job.id)
    why = [(e.kind, e.data) for e in events if "recovery" in e.kind or "fault" in e.kind]
    assert len(done.attempts) == 1, f"{why}\n{cluster.client.logs(job.id, rank=1, attempt=1).data}"
    (same,) = done.attempts  # recovered in process, twice: no second attempt
    assert {r.rank: r.pid for r in same.ranks}[0] == pids[0]
    assert {r.rank: r.node for r in same.ranks} == {0: "workers-0", 1: "spares-0"}
    rank1 = cluster.client.logs(job.id, rank=1).data
    assert {r.rank: r.pid for r in same.ranks}[1] != pids[1], f"{why}\n{rank1}"
    kinds = [e.kind for e in events]
    assert "recovery_decision" not in kinds, kinds
    recovered = [e.data["generation"] for e in events if e.kind == "in_process_recovery_done"]
    assert recovered == [1, 2], why

    log = cluster.client.logs(job.id, rank=0).data
    assert "generation 1: resumed at step" in log, log
    assert "generation 2: resumed at step" in log, log
    got = json.loads((durable / "summary.json").read_text())
    assert got["final_step"] == STEPS
    assert got["final_loss"] == undisturbed["final_loss"], (got, undisturbed)
    assert got["val_loss"] == undisturbed["val_loss"]
    assert _committed(durable)[-1] == STEPS  # saves went on after both recoveries
    # the last checkpoint's parts were written by the nodes that ran the ranks then
    (manifest,) = durable.rglob(f"{step_name(STEPS)}/manifest.json")
    written_by = {f.get("node") for f in json.loads(manifest.read_text())["files"]}
    assert written_by == {"workers-0", "spares-0"}, written_by
    cluster.wait_idle()


@pytest.mark.timeout(300)
def test_gpt_replaces_a_hung_rank_in_process(cluster: Cluster, tmp_path: Path) -> None:
    """A GPT rank that stops (SIGSTOP) is found by its peer's collective timeout (3 s here)
    and replaced in the same attempt: the healthy rank keeps its process and Checkpointer,
    the new one takes its state, and saves go on to the last step."""
    steps = 60
    durable = tmp_path / "ckpt"
    argv = ["python", str(GPT), "--steps", str(steps), "--ckpt-every", "5", "--eval-every", "0"]
    argv += ["--log-every", "10", "--ckpt-dir", str(durable), "--collective-timeout-s", "3"]
    job = cluster.submit(
        argv, nodes=2, procs_per_node=1, auto_resume=True, recovery="in-process", hang_timeout_s=3
    )
    wait_until(lambda: _committed(durable), timeout_s=90, what="a first committed checkpoint")
    (attempt,) = cluster.client.job(job.id).attempts
    pids = {r.rank: r.pid for r in attempt.ranks}
    cluster.client.chaos(ChaosRequest(node="workers-1", fault="hang", rank=1))
    done = cluster.wait_job(job.id, timeout_s=200)
    assert done.state == "completed", cluster.describe(done)
    events = cluster.client.events(job_id=job.id)
    why = [(e.kind, e.data) for e in events if "recovery" in e.kind or "fault" in e.kind]
    (same,) = done.attempts  # no second attempt
    now = {r.rank: r.pid for r in same.ranks}
    assert now[0] == pids[0] and now[1] != pids[1], why
    (started,) = [e.data for e in events if e.kind == "in_process_recovery_started"]
    assert started["replaced"] == [1] and "rank 1 stayed silent" in started["reason"], why
    assert [e.data["generation"] for e in events if e.kind == "in_process_recovery_done"] == [1]
    assert "joined generation 1 at step" in cluster.client.logs(job.id, rank=1).data
    assert _committed(durable)[-1] == steps  # saves went on after the recovery
    cluster.wait_idle()
