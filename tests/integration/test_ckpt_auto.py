"""``interval="auto"`` on a real local cluster: a job saves repeatedly at the interval its
costs call for, crashes, and resumes from the newest step with the MTBF the controller saw."""

from __future__ import annotations

import re

import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_ckpt_cluster import remove_memory

pytestmark = pytest.mark.integration

TRAIN = """\
import os, time, torch, torch.distributed as dist, trainpod
from trainpod.ckpt import IntervalBounds

dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TRAINPOD_ATTEMPT"])
# No MTBF in the job's spec: attempt 1 assumes the default (no fault seen), attempt 2 gets
# what the controller observed. The bounds keep the test short whatever the stall.
ck = trainpod.Checkpointer(interval="auto", bounds=IntervalBounds(min_s=0.1, max_s=0.5))
print(f"memory={ck.layout.memory.parent}", flush=True)
state = {"w": torch.zeros(64), "step": -1}
start = ck.load_latest(state)
print(f"rank={rank} attempt={attempt} start={start} tier={ck.last_load.tier} "
      f"w={state['w'][0].item():g} env_mtbf={os.environ.get('TRAINPOD_MTBF_S')}", flush=True)
saves = 0
# Attempt 1 runs until its 4th save (however long the interval comes out), attempt 2 a few
# intervals' worth of steps (its first two saves come 5 and 10 steps in: timing them).
end = 10**9 if start is None else start + 60
for step in range(0 if start is None else start + 1, end):
    time.sleep(0.01)
    state["w"].fill_(step)
    state["step"] = step
    trainpod.report(step)
    if ck.due(step):
        ck.save(step, state)
        saves += 1
        costs = ck.costs
        if costs is not None:
            print(f"rank={rank} attempt={attempt} saved={step} every={ck.interval_steps} "
                  f"mtbf={costs.mtbf_s:.0f}", flush=True)
        if attempt == 1 and saves == 4:
            assert ck.wait(60)  # committed everywhere: the newest step there is
            print(f"rank={rank} crash after={step}", flush=True)
            dist.barrier()
            if rank == 1:
                os._exit(3)
            dist.barrier()  # rank 0 waits here until the agent tears the attempt down
assert ck.close(60)
print(f"rank={rank} done", flush=True)
"""


def test_auto_saves_repeatedly_and_resumes_from_the_newest_step(cluster: Cluster) -> None:
    (cluster.workdir / "train.py").write_text(TRAIN)
    job = cluster.submit(
        ["python", "train.py"], nodes=2, procs_per_node=1, auto_resume=True, max_restarts=2
    )
    try:
        done = cluster.wait_job(job.id, timeout_s=140)
        assert done.state == "completed", f"{done.reason}\n{cluster.describe(done)}"
        first = cluster.client.logs(job.id, rank=0, attempt=1).data
        assert len(done.attempts) == 2 and done.attempts[0].cause == "crash", first
        assert "start=None" in first and "env_mtbf=None" in first, first
        crash = int(re.search(r"crash after=(\d+)", first).group(1))  # type: ignore[union-attr]
        saved = [e for e in cluster.client.events(job_id=job.id) if e.kind == "checkpoint_saved"]
        steps_1 = [e.data["step"] for e in saved if e.attempt == 1]
        assert len(steps_1) == 4 and steps_1 == sorted(steps_1) and steps_1[-1] == crash, saved
        # Before any fault the default MTBF (4 h) is assumed.
        assert "mtbf=14400" in first, first
        for rank in (0, 1):
            log = cluster.client.logs(job.id, rank=rank).data
            # From the node-local copies (a rank may read a shard DCP wrote on the other
            # node from its peer copy): the newest step, what the crash left.
            resumed = re.search(rf"attempt=2 start={crash} tier=(\S+) w={crash} ", log)
            assert resumed is not None, log
            assert set(resumed.group(1).split("+")) <= {"memory", "peer"}, log
            assert f"rank={rank} done" in log, log
        # Attempt 2 was launched with the MTBF the controller observed, and saves by it.
        second = cluster.client.logs(job.id, rank=0, attempt=2).data
        env = re.search(r"env_mtbf=(\d+)", second)
        assert env is not None, second
        assert f"mtbf={int(env.group(1))}\n" in second, second
        assert len([e for e in saved if e.attempt == 2]) >= 2, saved
    finally:
        remove_memory(cluster, job.id)
