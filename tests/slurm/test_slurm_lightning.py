"""The unmodified Lightning script (examples/lightning/train.py) on the real Slurm of the test
setup: each rank runs inside a Slurm job, yet Lightning takes its world from trainpod's
torchrun environment (TorchElasticEnvironment, world size 2), not from ``SLURM_*`` (the agent
scrubs those a framework derives ranks from); killed past its step-15 checkpoint,
``--auto-resume`` brings it back from its own ``last.ckpt`` and it ends with exactly the loss
of an undisturbed run beside it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_lightning import EVERY, FAULT_AFTER, FINAL, SCRIPT, STEP_TIME, STEPS
from tests.slurm.conftest import SlurmCI
from tests.slurm.test_slurm_backend import SPEC, SlurmCluster, slurm_cluster
from trainpod.api.models import ChaosRequest, JobInfo
from trainpod.testing.wait import wait_until


@pytest.fixture
def cluster(
    slurm: SlurmCI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SlurmCluster]:
    with slurm_cluster(slurm, tmp_path, monkeypatch, SPEC) as c:
        yield c


def command(ckpt: Path, step_time: float) -> list[str]:
    runner = [sys.executable, "-m", "trainpod.integrations.lightning", str(SCRIPT)]
    args = ["--ckpt-dir", str(ckpt), "--max-steps", str(STEPS), "--every", str(EVERY)]
    return [*runner, *args, "--batches-per-epoch", str(EVERY), "--step-time", str(step_time)]


def rank0(c: SlurmCluster, job: JobInfo, attempt: int) -> str:
    return c.client.logs(job.id, rank=0, attempt=attempt).data


@pytest.mark.timeout(400)
def test_lightning_on_slurm_takes_trainpods_world_and_resumes_from_last_ckpt(
    cluster: SlurmCluster,
) -> None:
    work = cluster.workdir
    ref = cluster.submit(command(work / "ref", 0.0), nodes=2, procs_per_node=1)
    job = cluster.submit(
        command(work / "ckpt", STEP_TIME), nodes=2, procs_per_node=1, auto_resume=True
    )

    def halfway() -> JobInfo | None:
        j = cluster.client.job(job.id)
        return j if ((j.progress or {}).get("last_checkpoint_step") or 0) >= FAULT_AFTER else None

    running = wait_until(halfway, timeout_s=240, what=f"job {job.id}'s step-15 checkpoint")
    cluster.client.chaos(ChaosRequest(node=running.attempts[-1].nodes[1], fault="kill-worker"))
    done = cluster.wait_job(job.id, timeout_s=240)
    undisturbed = cluster.wait_job(ref.id, timeout_s=120)
    assert (done.state, undisturbed.state) == ("completed", "completed"), done.reason
    assert len(done.attempts) == 2 and done.attempts[0].cause == "crash", done.attempts
    first = rank0(cluster, done, 1)
    want = "trainpod: Lightning's cluster environment is TorchElasticEnvironment, world size 2"
    assert want in first, first[-3000:]
    again = rank0(cluster, done, 2)
    assert f"trainpod: resuming from {work / 'ckpt' / 'last.ckpt'}\n" in again, again[-3000:]
    a = FINAL.search(again)
    b = FINAL.search(rank0(cluster, undisturbed, len(undisturbed.attempts)))
    assert a is not None and b is not None
    assert a.groups() == b.groups() and a.group(1, 2) == ("2", str(STEPS))
