"""Slurm's own preemption, mapped onto trainpod's notice, on a real Slurm (slurm-ci).

Partition ``low`` is preemptible by ``high`` (preempt/partition_prio, PreemptMode=REQUEUE,
GraceTime, ``SlurmctldParameters=preempt_send_user_signal``: see scripts/slurm-ci). What
Slurm 22.05 does, measured here: the batch shell gets ``--signal=B:USR1`` (and SIGCONT) the
moment the job is chosen; after GraceTime, SIGTERM and SIGKILL; then the job is requeued
(its restart count goes up). A batch script that exits during the grace is not requeued: it
ends FAILED, so the agents stay until Slurm ends the allocation.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.slurm.conftest import PREEMPT_GRACE_S
from tests.slurm.test_slurm_backend import SlurmCluster, cluster  # noqa: F401  (fixture)
from trainpod.api.models import JobInfo
from trainpod.errors import NotFound
from trainpod.testing.wait import wait_until

WORKER = str(Path(__file__).parents[1] / "integration" / "workers" / "preemptible.py")


def _log(c: SlurmCluster, job: JobInfo, rank: int, attempt: int) -> str:
    try:
        return c.client.logs(job.id, rank=rank, attempt=attempt).data
    except NotFound:  # the attempt (or its rank) has not started yet
        return ""


@pytest.mark.timeout(420)
def test_a_job_slurm_preempts_gets_the_notice_saves_is_requeued_and_resumes(
    cluster: SlurmCluster,  # noqa: F811
) -> None:
    c = cluster
    low = c.submit(
        [sys.executable, WORKER, "--every", "1000", "--more", "5"],
        nodes=2,
        procs_per_node=1,
        partition="low",
    )
    assert low.external
    wait_until(
        lambda: "step=5" in _log(c, low, 0, 1),
        timeout_s=120,
        what="the low-tier job to run a few steps",
    )
    outdir = c.paths.jobs_dir / str(low.id)  # the batch script's output (--output)
    # A high-tier job needs every node: Slurm preempts the low one (not trainpod).
    high = c.submit([sys.executable, "-c", "print('high')"], nodes=4, procs_per_node=1,
                    partition="high")  # fmt: skip
    preempted = c.wait_job(low.id, {"preempted"}, timeout_s=120)
    saved = [
        int(m.group(1))
        for r in (0, 1)
        if (m := re.search(r"saved-on-notice=(\d+)", _log(c, low, r, 1)))
    ]
    assert len(saved) == 2 and saved[0] == saved[1], (_log(c, low, 0, 1)[-1500:], saved)
    first = preempted.attempts[0]
    assert first.state == "failed" and first.cause == "preempted", first
    # Slurm ends the allocation after its GraceTime and requeues the job; the high job runs,
    # then the low one again, from the step it saved on the notice.
    t = c.slurm.timing
    budget = t.deadline(PREEMPT_GRACE_S, t.end_s, t.start_s) + 120
    assert c.wait_job(high.id, timeout_s=budget).state == "completed"
    done = c.wait_job(low.id, timeout_s=budget)
    assert done.state == "completed", done.reason
    assert len(done.attempts) == 2, done.attempts
    resumed = _log(c, low, 0, 2)
    assert f"start={saved[0]}" in resumed, resumed[-1500:]
    assert "rank=0 done" in resumed
    kinds = [k for k, _ in c.events(low.id)]
    assert "job_preempted" in kinds and "fault_detected" not in kinds, kinds
    requeued = [d for k, d in c.events(low.id) if k == "job_requeued"]
    assert [d.get("by") for d in requeued] == ["slurm"], requeued
    states = [d.get("new") for k, d in c.events(low.id) if k == "job_state"]
    assert "preempted" in states and "recovering" not in states, states
    out = next(outdir.glob("slurm-*.out")).read_text()
    assert "trainpod: Slurm preemption notice" in out, out[-2000:]
