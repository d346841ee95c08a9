"""trainpod.Checkpointer inside a job on a real local cluster: locations from the
environment, a crash, and the in-job restart that resumes from the memory tier; the agent's
persister, which uploads after the worker died, logs commits as events and removes the
job's shared memory when the job ends."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Cluster
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration

TRAIN = """\
import os, sys, torch, torch.distributed as dist, trainpod

dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TRAINPOD_ATTEMPT"])
ck = trainpod.Checkpointer(every=2)  # every location comes from the environment
print(f"memory={ck.layout.memory.parent}", flush=True)
print(f"rank={rank} tiers={[t.name for t in ck.tiers]} agent={ck.agent is not None}", flush=True)
state = {"w": torch.zeros(64), "step": -1}
start = ck.load_latest(state)
print(f"rank={rank} attempt={attempt} start={start} tier={ck.last_load.tier} "
      f"w={state['w'][0].item():g}", flush=True)
for step in range(0 if start is None else start + 1, 7):
    state["w"].fill_(step)
    state["step"] = step
    trainpod.report(step)
    if ck.due(step):
        ck.save(step, state)
    if step == 4 and attempt == 1:
        assert ck.wait(60)
        print(f"rank={rank} progress={ck.progress().committed}", flush=True)
        dist.barrier()
        if rank == 1:
            os._exit(3)  # a crash after step 4 was committed everywhere
        dist.barrier()  # rank 0 waits here until the agent tears the attempt down
assert ck.close(60)
print(f"rank={rank} done", flush=True)
"""


@pytest.mark.timeout(120)
def test_crash_and_in_job_restart_resume_from_the_memory_tier(cluster: Cluster) -> None:
    (cluster.workdir / "train.py").write_text(TRAIN)
    job = cluster.submit(
        ["python", "train.py"], nodes=2, procs_per_node=1, auto_resume=True, max_restarts=2
    )
    try:
        done = cluster.wait_job(job.id, timeout_s=120)
        assert done.state == "completed", done.reason
        assert len(done.attempts) == 2 and done.attempts[0].cause == "crash"
        first = cluster.client.logs(job.id, rank=0, attempt=1).data
        assert "tiers=['memory', 'scratch', 'peer', 'durable'] agent=True" in first
        assert "start=None" in first
        assert "'memory': 4, 'scratch': 4, 'peer': 4, 'durable': 4" in first
        for rank in (0, 1):
            log = cluster.client.logs(job.id, rank=rank).data
            assert "attempt=2 start=4 tier=memory" in log and "w=4" in log, log
            assert f"rank={rank} done" in log
        durable = Path(cluster.record.checkpoint_uri.removeprefix("file://")) / f"job-{job.id}"
        assert (durable / "step-0000000006" / "manifest.json").exists()
        events = checkpoint_events(cluster, job.id)
        assert ("checkpoint_committed", "durable", 6, None) in events, events
        assert ("checkpoint_committed", "scratch", 4, "workers-1") in events, events
        saved = [e for e in cluster.client.events(job_id=job.id) if e.kind == "checkpoint_saved"]
        assert [(e.attempt, e.data["step"]) for e in saved] == [(1, 0), (1, 2), (1, 4), (2, 6)]
        assert all(e.data["stall_s"] > 0 for e in saved)
        wait_memory_gone(cluster, job.id)  # the job ended: its agents removed its shared memory
    finally:
        remove_memory(cluster, job.id)


def checkpoint_events(cluster: Cluster, job_id: int) -> set[tuple[str, Any, Any, Any]]:
    return {
        (e.kind, e.data.get("tier"), e.data.get("step"), e.node)
        for e in cluster.client.events(job_id=job_id)
        if e.kind.startswith("checkpoint_")
    }


def memory_dir(cluster: Cluster, job_id: int) -> Path | None:
    """The job's shared-memory dir as its rank 0 printed it; None before it did. Not a glob
    on the job id: ids restart at 1 in every cluster and /dev/shm is the whole machine's, so
    the jobs of other clusters (other test sessions' too) have the same prefix."""
    m = re.search(r"^memory=(.+)$", cluster.client.logs(job_id, rank=0).data, re.MULTILINE)
    return Path(m.group(1)) if m else None


def wait_memory_gone(cluster: Cluster, job_id: int) -> None:
    d = wait_until(lambda: memory_dir(cluster, job_id), what=f"job {job_id}'s memory dir")
    wait_until(lambda: not d.exists(), timeout_s=60, what=f"job {job_id}'s {d} gone")


def remove_memory(cluster: Cluster, job_id: int) -> None:
    d = memory_dir(cluster, job_id)
    if d is not None:
        shutil.rmtree(d, ignore_errors=True)


KILLED = """\
import os, signal, time, torch, torch.distributed as dist, trainpod

dist.init_process_group("gloo")

def die_after_the_memory_commit(event, step):
    if event == "committed:memory" and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # the hand-off to the agent came just before

# 1 MiB per rank at 1 MB/s to peer and durable: the uploads outlive the worker by far.
ck = trainpod.Checkpointer(every=2, bandwidth_bps=1e6, on_event=die_after_the_memory_commit)
assert ck.agent is not None
print(f"memory={ck.layout.memory.parent}", flush=True)
state = {"w": torch.zeros(256 * 1024)}
for step in range(3):
    state["w"].fill_(step)
    trainpod.report(step)
    if ck.due(step):
        ck.save(step, state)
time.sleep(120)  # not reached
"""

SAVE_AND_WAIT = """\
import time, torch, torch.distributed as dist, trainpod

dist.init_process_group("gloo")
ck = trainpod.Checkpointer(every=1)
print(f"memory={ck.layout.memory.parent}", flush=True)
ck.save(1, {"w": torch.ones(1024)})
assert ck.wait(60)
print("committed", ck.progress().committed, flush=True)
while True:  # until cancelled
    trainpod.report(1)
    time.sleep(0.2)
"""


@pytest.mark.timeout(120)
def test_the_agent_uploads_after_the_worker_was_killed_and_cleans_up(cluster: Cluster) -> None:
    (cluster.workdir / "killed.py").write_text(KILLED)
    (cluster.workdir / "wait.py").write_text(SAVE_AND_WAIT)
    durable = Path(cluster.record.checkpoint_uri.removeprefix("file://"))
    job = cluster.submit(["python", "killed.py"], nodes=2, procs_per_node=1)
    cancelled = None
    try:
        done = cluster.wait_job(job.id, timeout_s=120)
        assert done.state == "failed", done.reason  # both ranks SIGKILLed themselves
        # Step 2 was only in shared memory when the workers died: the agents' persisters
        # uploaded both nodes' parts and one of them committed it.
        manifest = durable / f"job-{job.id}" / "step-0000000002" / "manifest.json"
        wait_until(manifest.exists, timeout_s=60, what="step 2 in the durable store")
        wait_until(
            lambda: (
                ("checkpoint_committed", "durable", 2, None) in checkpoint_events(cluster, job.id)
            ),
            timeout_s=30,
            what="the durable commit event",
        )
        committed = [
            e
            for e in cluster.client.events(job_id=job.id)
            if e.kind == "checkpoint_committed" and e.data["tier"] == "durable"
        ]
        # Once per step, not per node (step 0 may have been superseded by step 2).
        steps = [e.data["step"] for e in committed]
        assert 2 in steps and len(steps) == len(set(steps)), steps
        assert committed[-1].data["by"] in ("workers-0", "workers-1")
        wait_memory_gone(cluster, job.id)

        # A cancelled job's shared memory goes too (after its persisters finished).
        cancelled = cluster.submit(["python", "wait.py"], nodes=2, procs_per_node=1).id
        wait_until(
            lambda: "committed" in cluster.client.logs(cancelled, rank=0).data,
            timeout_s=90,
            what="the second job's commit",
        )
        d = memory_dir(cluster, cancelled)
        assert d is not None and d.exists(), d
        cluster.client.cancel(cancelled)
        assert cluster.wait_job(cancelled).state == "cancelled"
        wait_memory_gone(cluster, cancelled)
        assert (durable / f"job-{cancelled}" / "step-0000000001" / "manifest.json").exists()
    finally:
        remove_memory(cluster, job.id)
        if cancelled is not None:
            remove_memory(cluster, cancelled)
