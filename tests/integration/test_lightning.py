"""An unmodified PyTorch Lightning script (examples/lightning/train.py) on a real 2-node local
cluster, run through ``python -m trainpod.integrations.lightning``: Lightning takes its world
from torchrun's environment (TorchElasticEnvironment, world size 2); after a rank is killed
past the step-15 checkpoint of 40, ``--auto-resume`` brings it back from its own
``last.ckpt`` (handed to ``fit`` as ``ckpt_path``) and it ends with exactly the loss of an
undisturbed run beside it; the integration's beacons show in ``trainpod show`` and in the
job's TensorBoard dir; a preemption notice makes Lightning save ``last-trainpod.ckpt`` at
once, the rank stops, and the job resumes from that save.

Lightning's import takes ~10-30 s a rank on this box: two tests, two attempts each."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.conftest import Cluster
from trainpod.api.models import ChaosRequest, JobInfo
from trainpod.telemetry.tensorboard import STEPS_RUN, tensorboard_dir
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parents[2] / "examples" / "lightning" / "train.py"
STEPS, EVERY = 40, 5
FAULT_AFTER = 15
"""The fault comes after the checkpoint of this step: 25 steps before the end, each at least
STEP_TIME (the script sleeps that long per step), leave time to inject it on a busy box."""
STEP_TIME = 0.5
FINAL = re.compile(r"^world_size=(\d+) step=(\d+) final_loss=(\S+)$", re.MULTILINE)


def command(ckpt: Path, step_time: float) -> list[str]:
    """The script as a user submits it: unmodified, under trainpod's Lightning runner."""
    runner = ["python", "-m", "trainpod.integrations.lightning", str(SCRIPT)]
    args = ["--ckpt-dir", str(ckpt), "--max-steps", str(STEPS), "--every", str(EVERY)]
    return [*runner, *args, "--batches-per-epoch", str(EVERY), "--step-time", str(step_time)]


def final(cluster: Cluster, job: JobInfo) -> tuple[int, int, str]:
    """(world size, step, final loss) that rank 0 of the job's last attempt printed."""
    log = cluster.client.logs(job.id, rank=0, attempt=len(job.attempts)).data
    m = FINAL.search(log)
    assert m is not None, f"no final_loss in rank 0's last log of job {job.id}:\n{log[-3000:]}"
    return int(m.group(1)), int(m.group(2)), m.group(3)


def progress(cluster: Cluster, job_id: int) -> dict[str, Any]:
    """The running attempt's progress from the ranks' beacons (what ``trainpod show`` shows)."""
    return cluster.client.job(job_id).progress or {}


def scalars(run: Path, tag: str) -> list[int]:
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


@pytest.mark.timeout(420)
def test_a_killed_lightning_script_resumes_from_its_last_ckpt_with_the_same_loss(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(workers=4)
    work = cluster.workdir
    reference = cluster.submit(command(work / "ref", 0.0), nodes=2, procs_per_node=1)
    job = cluster.submit(
        command(work / "ckpt", STEP_TIME), nodes=2, procs_per_node=1, auto_resume=True
    )

    def halfway() -> dict[str, Any] | None:  # a checkpoint at step 15 is written
        p = progress(cluster, job.id)
        return p if (p.get("last_checkpoint_step") or 0) >= FAULT_AFTER else None

    wait_until(halfway, timeout_s=150, what=f"job {job.id} past its step-15 checkpoint")
    shown = json.loads(cluster.cli("show", str(job.id), "--json").stdout)["progress"]
    assert shown["ranks"] == 2 and shown["last_step"] >= FAULT_AFTER, shown
    (node,) = [n for n in cluster.client.job(job.id).attempts[0].nodes[1:]]
    cluster.client.chaos(ChaosRequest(node=node, fault="kill-worker"))

    done = cluster.wait_job(job.id, timeout_s=240)
    ref = cluster.wait_job(reference.id, timeout_s=60)
    assert (done.state, ref.state) == ("completed", "completed"), (done.reason, ref.reason)
    assert [a.cause for a in done.attempts][:1] == ["crash"] and len(done.attempts) == 2
    assert len(ref.attempts) == 1, [(a.number, a.cause) for a in ref.attempts]
    again = cluster.client.logs(job.id, rank=0, attempt=2).data
    m = re.search(r"^trainpod: resuming from (\S+)$", again, re.MULTILINE)
    assert m is not None and m.group(1) == str(work / "ckpt" / "last.ckpt"), again[-3000:]
    assert re.search(r"Restored all states from the checkpoint at .*last\.ckpt", again), again
    # TorchElasticEnvironment took the world from trainpod's env; the loss is bit-for-bit
    assert final(cluster, done) == final(cluster, ref) == (2, STEPS, final(cluster, ref)[2])
    # the integration's beacons: loss and samples/s in the job's TensorBoard dir
    logdir = tensorboard_dir(Path(cluster.record.shared_dir), reference.id)
    assert scalars(logdir / STEPS_RUN, "metrics/loss") == list(range(1, STEPS + 1))
    assert scalars(logdir / STEPS_RUN, "metrics/samples_per_s")
    assert scalars(logdir / "lightning", "loss") == list(range(1, STEPS + 1))


@pytest.mark.timeout(420)
def test_a_preemption_notice_makes_lightning_save_and_the_job_resume_from_that_save(
    cluster: Cluster,
) -> None:
    ckpt = cluster.workdir / "ckpt"
    job = cluster.submit(command(ckpt, STEP_TIME), nodes=2, procs_per_node=1)
    wait_until(
        lambda: (progress(cluster, job.id).get("last_step") or 0) > EVERY + 2,
        timeout_s=150,
        what=f"job {job.id} past step {EVERY + 2}",
    )
    cluster.client.preempt(job.id, "a test needs the nodes", grace_s=60)
    done = cluster.wait_job(job.id, timeout_s=270)
    assert done.state == "completed", done.reason
    first, second = done.attempts
    assert (first.cause, second.state) == ("preempted", "succeeded")
    before = cluster.client.logs(job.id, rank=0, attempt=1).data
    m = re.search(r"^trainpod: notice at step (\d+): saved (\S+)$", before, re.MULTILINE)
    assert m is not None, before[-3000:]
    noticed, saved = int(m.group(1)), m.group(2)
    assert saved == str(ckpt / "last-trainpod.ckpt") and EVERY + 2 < noticed < STEPS
    after = cluster.client.logs(job.id, rank=0, attempt=2).data
    assert f"trainpod: resuming from {saved}\n" in after, after[-3000:]
    assert final(cluster, done)[:2] == (2, STEPS)
