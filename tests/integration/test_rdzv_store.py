"""The node leader's agent hosts each attempt's rendezvous store (ADR 0028), as torchrun's
launcher does: ranks may end in any order, and an unmodified torchrun script resumes from its
own snapshot after a fault with the same final loss as an undisturbed run."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from trainpod.api.models import ChaosRequest
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
WORKERS = Path(__file__).parent / "workers"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun" / "snapshot_train.py"
FINAL = re.compile(r"rank 0: final loss (\S+) ")


def test_rank_0_may_leave_before_rank_1_tears_down(cluster: Cluster, tmp_path: Path) -> None:
    """Rank 1 reads the store after rank 0's process has gone: with rank 0 hosting the store
    it finds nobody there, fails, and the finished job is restarted."""
    job = cluster.submit(
        ["python", str(WORKERS / "exit_order.py"), str(tmp_path)],
        nodes=2,
        procs_per_node=1,
        auto_resume=True,
        max_restarts=1,
    )
    done = cluster.wait_job(job.id)
    assert done.state == "completed", f"{done.reason}\n{cluster.describe(done)}"
    assert len(done.attempts) == 1, cluster.describe(done)  # no restart
    log = cluster.client.logs(job.id, rank=1).data
    assert "rank 0 has gone; tearing down" in log and "rank 0 left result 6.0; done" in log, log
    cluster.wait_idle()


def snapshot_job(cluster: Cluster, snapshots: Path, epochs: int) -> int:
    argv = ["python", str(EXAMPLE), "--total-epochs", str(epochs), "--save-every", "2"]
    # 128 steps per rank and epoch (batch 2): an epoch takes ~0.3 s here, so the fault the
    # test aims after the second snapshot cannot come after the run has ended (at batch 32
    # the remaining eight epochs took ~0.15 s, the test's own look and SIGSTOP about as long).
    argv += ["--samples", "512", "--batch-size", "2", "--snapshot-dir", str(snapshots)]
    return cluster.submit(argv, nodes=2, procs_per_node=1, auto_resume=True, max_restarts=2).id


def final_loss(cluster: Cluster, job_id: int, attempt: int) -> str:
    log = cluster.client.logs(job_id, rank=0, attempt=attempt).data
    found = FINAL.search(log)
    assert found is not None, log
    return found.group(1)


@pytest.mark.timeout(360)
def test_an_unmodified_torchrun_script_resumes_from_its_own_snapshot(
    cluster: Cluster, tmp_path: Path
) -> None:
    epochs = 12
    calm = snapshot_job(cluster, tmp_path / "calm", epochs)
    done = cluster.wait_job(calm, timeout_s=120)
    assert done.state == "completed", cluster.describe(done)
    # Read from attempt 1 and 2 only: torch 2.13's Gloo may abort a rank at interpreter exit
    # after its work (see workers/torchrun_style.py), and the restart that follows resumes
    # from the last snapshot and prints the same loss again.
    undisturbed = final_loss(cluster, calm, attempt=1)

    job = snapshot_job(cluster, tmp_path / "faulty", epochs)
    saved = "rank 0: epoch 3: snapshot saved"  # two snapshots in
    wait_until(
        lambda: saved in cluster.client.logs(job, rank=0).data,
        timeout_s=90,
        what="the second snapshot",
    )
    # Hold the run where it is (rank 0 then waits for rank 1 at its next collective), so
    # the fault lands half way however slow the machine, then kill rank 1.
    (attempt,) = cluster.client.job(job).attempts
    pid = next(r.pid for r in attempt.ranks if r.rank == 1)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    cluster.client.chaos(ChaosRequest(node="workers-1", fault="kill-worker", rank=1))
    done = cluster.wait_job(job, timeout_s=150)
    assert done.state == "completed", f"{done.reason}\n{cluster.describe(done)}"
    assert [a.cause for a in done.attempts][:1] == ["crash"], cluster.describe(done)
    first = cluster.client.logs(job, rank=0, attempt=1).data
    assert f"epoch {epochs - 1}:" not in first, first  # the first attempt did not finish
    last = cluster.client.logs(job, rank=0, attempt=2).data
    resumed = re.search(r"rank 0: resuming from snapshot at epoch (\d+)", last)
    assert resumed is not None, last
    assert 4 <= int(resumed.group(1)) < epochs, last  # from its own snapshot, half way
    assert "epoch 0:" not in last, last  # nothing from before the snapshot was run again
    assert final_loss(cluster, job, attempt=2) == undisturbed  # bitwise: the float's hex
