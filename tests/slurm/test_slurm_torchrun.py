"""The unmodified torchrun script (examples/torchrun/snapshot_train.py) on the real Slurm of the
test setup: its two ranks run in a Slurm job on two nodes, with the torchrun environment
trainpod gives them; killed past its halfway snapshot, ``--auto-resume`` brings it back from
its own ``snapshot.pt`` and it ends with exactly the loss of an undisturbed run beside it
(the float's hex: the script is deterministic)."""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_rdzv_store import EXAMPLE, FINAL
from tests.slurm.conftest import SlurmCI
from tests.slurm.test_slurm_backend import SPEC, SlurmCluster, slurm_cluster
from trainpod.api.models import ChaosRequest, JobInfo
from trainpod.errors import NotFound
from trainpod.testing.wait import wait_until

EPOCHS, HALF = 16, 8
"""The run's epochs; it snapshots every 2, and the fault comes once ``HALF`` are saved."""
PACE = ["--samples", "2048", "--batch-size", "2"]
"""512 steps per rank and epoch (under a second on a loaded 2-core box): the 8 epochs left
after the halfway snapshot leave seconds to stop rank 1 before the run could end (it was
stopped one epoch after the snapshot, measured)."""


@pytest.fixture
def cluster(
    slurm: SlurmCI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SlurmCluster]:
    with slurm_cluster(slurm, tmp_path, monkeypatch, SPEC) as c:
        yield c


def submit(c: SlurmCluster, snapshots: Path) -> JobInfo:
    argv = [sys.executable, str(EXAMPLE), "--total-epochs", str(EPOCHS), "--save-every", "2"]
    # max_restarts 2: the fault's, and one for torch's Gloo, which may abort a rank at
    # interpreter exit after its work (see tests/integration/test_rdzv_store.py).
    return c.submit(
        [*argv, *PACE, "--snapshot-dir", str(snapshots)],
        nodes=2,
        procs_per_node=1,
        auto_resume=True,
        max_restarts=2,
    )


def rank0(c: SlurmCluster, job: JobInfo, attempt: int) -> str:
    try:
        return c.client.logs(job.id, rank=0, attempt=attempt).data
    except NotFound:  # the attempt has not started yet
        return ""


def final_loss(c: SlurmCluster, job: JobInfo, attempt: int) -> str:
    log = rank0(c, job, attempt)
    found = FINAL.search(log)
    assert found is not None, log[-3000:]
    return found.group(1)


@pytest.mark.timeout(400)
def test_a_torchrun_script_on_slurm_resumes_from_its_own_snapshot_with_the_same_loss(
    cluster: SlurmCluster,
) -> None:
    work = cluster.workdir
    ref = submit(cluster, work / "ref")
    job = submit(cluster, work / "snap")
    saved = f"rank 0: epoch {HALF - 1}: snapshot saved"
    wait_until(lambda: saved in rank0(cluster, job, 1), timeout_s=240, what="the half-way snapshot")
    # Hold the run where it is (rank 0 then waits for rank 1 at its next collective), so the
    # fault lands past half way however slow the machine, then kill rank 1 through chaos.
    (attempt,) = cluster.client.job(job.id).attempts
    zero, one = sorted(attempt.ranks, key=lambda r: r.rank)
    assert one.pid is not None and one.node != zero.node, attempt  # two nodes of Slurm's
    os.kill(one.pid, signal.SIGSTOP)
    cluster.client.chaos(ChaosRequest(node=one.node, fault="kill-worker", rank=1))
    done = cluster.wait_job(job.id, timeout_s=240)
    undisturbed = cluster.wait_job(ref.id, timeout_s=120)
    assert (done.state, undisturbed.state) == ("completed", "completed"), done.reason
    assert done.attempts[0].cause == "crash", done.attempts
    first = rank0(cluster, done, 1)
    assert "final loss" not in first, first[-3000:]  # the first attempt did not finish
    again = rank0(cluster, done, 2)
    resumed = re.search(r"rank 0: resuming from snapshot at epoch (\d+)", again)
    assert resumed is not None, again[-3000:]
    assert HALF <= int(resumed.group(1)) < EPOCHS, again[-3000:]  # its own, past half way
    assert "epoch 0:" not in again, again[-3000:]  # nothing before the snapshot ran again
    # Attempt 1 of the undisturbed run: a Gloo abort at exit restarts a finished job, and
    # its restart prints the same loss again from the last snapshot.
    assert final_loss(cluster, done, 2) == final_loss(cluster, undisturbed, 1)
