"""trainpod.Checkpointer inside a job on a real local cluster: locations from the
environment, a crash, and the in-job restart that resumes from the memory tier."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

TRAIN = """\
import os, sys, torch, torch.distributed as dist, trainpod

dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TRAINPOD_ATTEMPT"])
ck = trainpod.Checkpointer(every=2)  # every location comes from the environment
print(f"rank={rank} tiers={[t.name for t in ck.tiers]}", flush=True)
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
        assert "tiers=['memory', 'scratch', 'peer', 'durable']" in first
        assert "start=None" in first
        assert "'memory': 4, 'scratch': 4, 'peer': 4, 'durable': 4" in first
        for rank in (0, 1):
            log = cluster.client.logs(job.id, rank=rank).data
            assert "attempt=2 start=4 tier=memory" in log and "w=4" in log, log
            assert f"rank={rank} done" in log
        durable = Path(cluster.record.checkpoint_uri.removeprefix("file://")) / f"job-{job.id}"
        assert (durable / "step-0000000006" / "manifest.json").exists()
    finally:
        for d in Path("/dev/shm/trainpod").glob(f"job-{job.id}-*"):
            shutil.rmtree(d, ignore_errors=True)
