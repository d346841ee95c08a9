"""Which of Slurm's signals is a preemption, on a real Slurm (slurm-ci, 22.05).

The batch script's ``--signal=B:USR1@LEAD`` also goes out LEAD seconds before ``--time`` runs
out: that is not a preemption (nothing requeues the job), and the agents tell it apart by
Slurm's record of the job (``PreemptTime``, ``EndTime``; agent/slurmnotice.py). Where
slurm.conf lacks ``preempt_send_user_signal`` Slurm sends no user signal at preemption but
SIGTERM to the job's tasks (the agents and their ranks) when it chooses the job, GraceTime
before the end: the agents take that SIGTERM as the notice.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.conftest import PREEMPT_GRACE_S, SlurmCI
from tests.slurm.test_slurm_backend import SPEC, SlurmCluster, slurm_cluster
from tests.slurm.test_slurm_preemption import WORKER, _log
from trainpod.testing.wait import WaitTimeout, wait_until

# A lead Slurm cannot miss: it checks time limits (and sends their warnings) every 30 s.
LEAD_S = 50
USER_SIGNAL = "SlurmctldParameters=preempt_send_user_signal"


def _slurm_output(c: SlurmCluster, job_id: int) -> str:
    return "".join(p.read_text() for p in (c.paths.jobs_dir / str(job_id)).glob("slurm-*.out"))


@pytest.mark.timeout(300)
def test_the_time_limits_warning_is_not_taken_for_a_preemption(
    slurm: SlurmCI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = SPEC.replace("grace_s: 15", f"grace_s: {LEAD_S}")
    with slurm_cluster(slurm, tmp_path, monkeypatch, spec) as c:
        job = c.submit(
            [sys.executable, WORKER, "--every", "1000", "--more", "5"],
            nodes=2,
            procs_per_node=1,
            time_limit="1",  # a minute: the --signal goes out 50 s before its end
        )
        t = c.slurm.timing
        done = c.wait_job(job.id, timeout_s=t.deadline(60, t.end_s, t.start_s) + 90)
        out = _slurm_output(c, job.id)
        assert "trainpod: Slurm preemption notice" in out, out[-2000:]  # the trap ran
        assert "is the time limit's warning, not a preemption" in out, out[-3000:]
        assert done.state == "failed", (done.state, done.reason)
        kinds = [k for k, _ in c.events(job.id)]
        assert "job_preempted" not in kinds, kinds
        assert "saved-on-notice" not in _log(c, done, 0, 1)  # the ranks were not told


@contextlib.contextmanager
def without_user_signal(slurm: SlurmCI) -> Iterator[None]:
    """The session's Slurm without ``preempt_send_user_signal`` (Slurm's default), put back
    after: ``scontrol reconfigure`` applies either way (measured)."""
    text = slurm.conf.read_text()
    assert USER_SIGNAL in text, "scripts/slurm-ci up --preempt-grace sets it"

    def apply(conf: str, want: str) -> None:
        slurm.conf.write_text(conf)
        slurm.run("scontrol", "reconfigure")
        wait_until(
            lambda: want in slurm.run("scontrol", "show", "config").stdout.replace(" ", ""),
            timeout_s=30,
            what=f"slurmctld to read {want}",
        )

    apply(text.replace(USER_SIGNAL, f"#{USER_SIGNAL}"), "SlurmctldParameters=(null)")
    try:
        yield
    finally:
        apply(text, "SlurmctldParameters=preempt_send_user_signal")


@pytest.mark.timeout(420)
def test_without_the_user_signal_slurms_sigterm_is_the_notice(
    slurm: SlurmCI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with without_user_signal(slurm), slurm_cluster(slurm, tmp_path, monkeypatch, SPEC) as c:
        low = c.submit(
            [sys.executable, WORKER, "--every", "3", "--more", "5"],
            nodes=2,
            procs_per_node=1,
            partition="low",
        )
        wait_until(lambda: "step=5" in _log(c, low, 0, 1), timeout_s=120, what="low to run")
        high = c.submit(
            [sys.executable, "-c", "print('high')"], nodes=4, procs_per_node=1, partition="high"
        )
        try:
            preempted = c.wait_job(low.id, {"preempted"}, timeout_s=120)
        except WaitTimeout as exc:
            job = c.client.job(low.id)
            raise AssertionError(
                f"{exc}\njob: {job.state} {job.reason}\nevents: {c.events(low.id)}\n"
                f"Slurm's output:\n{_slurm_output(c, low.id)[-6000:]}"
            ) from None
        first = preempted.attempts[0]
        assert first.state == "failed" and first.cause == "preempted", first
        t = c.slurm.timing
        budget = t.deadline(PREEMPT_GRACE_S, t.end_s, t.start_s) + 120
        assert c.wait_job(high.id, timeout_s=budget).state == "completed"
        done = c.wait_job(low.id, timeout_s=budget)
        assert done.state == "completed", done.reason
        assert len(done.attempts) == 2, done.attempts
        assert "rank=0 done" in _log(c, done, 0, 2)
        out = _slurm_output(c, low.id)
        assert "SIGTERM is Slurm's preemption notice" in out, out[-3000:]
        assert "trainpod: Slurm preemption notice" not in out  # no user signal was sent
        kinds = [k for k, _ in c.events(low.id)]
        assert "job_preempted" in kinds and "fault_detected" not in kinds, kinds
        requeued = [d for k, d in c.events(low.id) if k == "job_requeued"]
        assert [d.get("by") for d in requeued] == ["slurm"], requeued
        states = [d.get("new") for k, d in c.events(low.id) if k == "job_state"]
        assert "preempted" in states and "recovering" not in states, states
