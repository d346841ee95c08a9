"""Checkpoint-aware preemption on a real local cluster: a job preempted by hand through the
API gets the notice, saves at once and exits, waits as ``preempted``, runs again and resumes
from the step it saved (from the memory tier: same nodes), losing no step beyond it; a
script that ignores the notice gets the grace, then SIGTERM, and resumes from its last
periodic checkpoint; goodput counts the preemption in a bucket of its own, never a fault."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_ckpt_cluster import remove_memory
from trainpod.api.models import JobInfo
from trainpod.testing.wait import WaitTimeout, wait_until

pytestmark = pytest.mark.integration
WORKER = str(Path(__file__).parent / "workers" / "preemptible.py")
EVERY = 5


def steps(cluster: Cluster, job_id: int, attempt: int, rank: int) -> list[int]:
    log = cluster.client.logs(job_id, rank=rank, attempt=attempt).data
    return [int(m) for m in re.findall(rf"attempt={attempt} step=(\d+)$", log, re.MULTILINE)]


def logged(cluster: Cluster, job_id: int, attempt: int, rank: int, key: str) -> str:
    log = cluster.client.logs(job_id, rank=rank, attempt=attempt).data
    m = re.search(rf"^rank={rank} attempt={attempt} .*?{key}=(\S+)", log, re.MULTILINE)
    assert m is not None, f"no {key}= in rank {rank}'s log of attempt {attempt}:\n{log}"
    return m.group(1)


def run_and_preempt(cluster: Cluster, *args: str, grace_s: float, cli: bool = False) -> JobInfo:
    """Start the worker on both nodes, preempt it (through the API, or ``trainpod preempt``)
    past its second periodic checkpoint, and return the job once its resumed attempt has
    completed."""
    argv = ["python", WORKER, "--every", str(EVERY), *args]
    job = cluster.submit(argv, nodes=2, procs_per_node=1)
    wait_until(
        lambda: min(len(steps(cluster, job.id, 1, r)) for r in (0, 1)) > 2 * EVERY + 1,
        timeout_s=120,
        what=f"job {job.id} past step {2 * EVERY}",
    )
    wait_until(  # a periodic checkpoint is in shared memory on both nodes
        lambda: any(
            e.kind == "checkpoint_saved" and e.data["step"] >= EVERY
            for e in cluster.client.events(job_id=job.id)
        ),
        timeout_s=60,
        what=f"job {job.id}'s checkpoint of step {EVERY}",
    )
    why = "a test needs the nodes"
    if cli:
        out = cluster.cli("preempt", str(job.id), "--reason", why, "--grace-s", str(grace_s))
        assert out.stdout.strip() == f"job {job.id}: stopping ({why})", out.stdout
    else:
        info = cluster.client.preempt(job.id, why, grace_s=grace_s)
        assert (info.state, info.reason) == ("stopping", why)
    try:
        done = cluster.wait_job(job.id, timeout_s=150)
    except WaitTimeout as exc:  # say where each rank's last attempt stood
        number = len(cluster.client.job(job.id).attempts)
        tails = [cluster.client.logs(job.id, rank=r, attempt=number).data[-3000:] for r in (0, 1)]
        raise WaitTimeout(f"{exc}\n" + "\n".join(tails)) from None
    assert done.state == "completed", done.reason
    first, second = done.attempts
    assert (first.cause, first.state, second.state) == ("preempted", "failed", "succeeded")
    assert first.nodes == second.nodes  # nothing else waits: back on the same nodes
    states = [e.data["new"] for e in cluster.client.events(job_id=job.id) if e.kind == "job_state"]
    assert "preempted" in states, states  # it waited in the queue as preempted
    kinds = {e.kind for e in cluster.client.events(job_id=job.id)}
    assert "job_preempted" in kinds
    assert not kinds & {"fault_detected", "recovery_decision"}  # no fault, no restart used
    goodput = cluster.client.goodput(job.id)
    assert goodput["buckets"]["preemption"] > 0, goodput
    assert goodput["faults"] == [] and goodput["buckets"]["teardown"] == 0, goodput
    if cli:
        table = cluster.cli("goodput", str(job.id)).stdout
        assert re.search(r"^preemption +\d+\.\d", table, re.MULTILINE), table
    return done


@pytest.mark.timeout(300)
def test_a_preempted_job_saves_on_the_notice_and_resumes_from_that_step(
    cluster: Cluster,
) -> None:
    job_id = None
    try:
        done = run_and_preempt(cluster, grace_s=120)  # it exits long before: no SIGTERM
        job_id = done.id
        assert [r.exit_code for r in done.attempts[0].ranks] == [0, 0]  # exited on its own
        saved = {int(logged(cluster, done.id, 1, r, "saved-on-notice")) for r in (0, 1)}
        assert len(saved) == 1, saved  # sync=True: both ranks stopped at the same step
        (step,) = saved
        for rank in (0, 1):
            before, after = steps(cluster, done.id, 1, rank), steps(cluster, done.id, 2, rank)
            assert before == list(range(step + 1))  # nothing ran past the saved step
            assert logged(cluster, done.id, 2, rank, "start") == str(step)
            # Its shared memory was kept while it waited (its own part; a file only the other
            # node wrote comes from its peer copy): same nodes, fastest tier.
            tier = logged(cluster, done.id, 2, rank, "tier")
            assert tier.split("+")[0] == "memory", tier
            assert after[0] == step + 1  # no step lost, none done twice
            assert "done" in cluster.client.logs(done.id, rank=rank).data
    finally:
        if job_id is not None:
            remove_memory(cluster, job_id)


@pytest.mark.timeout(300)
def test_a_script_that_ignores_the_notice_gets_the_grace_then_sigterm(
    cluster: Cluster,
) -> None:
    job_id = None
    try:
        done = run_and_preempt(cluster, "--ignore", grace_s=1, cli=True)
        job_id = done.id
        # Not killed by the notice (ranks start with it ignored): by teardown's SIGTERM. Each
        # node's agent sends its own; a rank whose peer died first may end on the broken
        # collective before its SIGTERM comes (seen on a loaded box: exit 1, 45 ms before).
        ended = [(r.signal, r.exit_code) for r in done.attempts[0].ranks]
        assert (signal.SIGTERM, None) in ended, ended
        assert all(sig in (signal.SIGTERM, None) and code != 0 for sig, code in ended), ended
        for rank in (0, 1):
            assert (
                "notice signal ignored at start: True"
                in cluster.client.logs(done.id, rank=rank, attempt=1).data
            )
            before, after = steps(cluster, done.id, 1, rank), steps(cluster, done.id, 2, rank)
            start = int(logged(cluster, done.id, 2, rank, "start"))
            # Back to its last periodic checkpoint (committed before the SIGTERM).
            assert start % EVERY == 0 and EVERY <= start <= before[-1], (start, before[-1])
            assert after[0] == start + 1
    finally:
        if job_id is not None:
            remove_memory(cluster, job_id)
