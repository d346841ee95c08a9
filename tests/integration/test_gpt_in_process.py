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
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration

GPT = Path(__file__).parents[2] / "examples" / "gpt" / "train.py"
STEPS = 120
ARGS = ["--steps", str(STEPS), "--ckpt-every", "5", "--eval-every", "0", "--log-every", "10"]


def _committed(durable: Path) -> list[int]:
    return sorted(int(m.parent.name.split("-")[1]) for m in durable.rglob("step-*/manifest.json"))


@pytest.mark.timeout(360)
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
    done = cluster.wait_job(job.id, timeout_s=200)
    assert done.state == "completed", cluster.describe(done)
    events = cluster.client.events(job_id=job.id)
    why = [(e.kind, e.data) for e in events if "recovery" in e.kind or "fault" in e.kind]
    assert len(done.attempts) == 1, f"{why}\n{cluster.client.logs(job.id, rank=1, attempt=1).data}"
    (same,) = done.attempts  # recovered in process: no second attempt
    assert {r.rank: r.pid for r in same.ranks}[0] == pids[0]
    rank1 = cluster.client.logs(job.id, rank=1).data
    assert {r.rank: r.pid for r in same.ranks}[1] != pids[1], f"{why}\n{rank1}"
    kinds = [e.kind for e in events]
    assert "in_process_recovery_done" in kinds and "recovery_decision" not in kinds, kinds

    log = cluster.client.logs(job.id, rank=0).data
    assert "generation 1: resumed at step" in log, log
    got = json.loads((durable / "summary.json").read_text())
    assert got["final_step"] == STEPS
    assert got["final_loss"] == undisturbed["final_loss"], (got, undisturbed)
    assert got["val_loss"] == undisturbed["val_loss"]
    assert _committed(durable)[-1] == STEPS  # saves went on after the recovery
    cluster.wait_idle()
