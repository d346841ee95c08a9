"""Checkpoints under faults on a real local cluster: a memory tier too small for the step
(a 1 MiB tmpfs, real ENOSPC) sends each save to scratch, with an event; and the agent
SIGKILLed in the middle of a hand-off (the test seam TRAINPOD_TEST_DIE_IN_HANDOFF, see
trainpod.agent.chaos): no torn commit, the job resumes from the last committed step, and the
half-handed-over step is completed by the persister, reported by the next agent."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from trainpod.agent.chaos import DIE_IN_HANDOFF_ENV
from trainpod.testing.tmpfs import TmpfsUnavailable, tmpfs
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
MiB = 1 << 20

SHM_FULL = """\
import sys, torch, trainpod

ck = trainpod.Checkpointer(every=1, memory=sys.argv[1])  # a 1 MiB tmpfs
assert ck.agent is not None
state = {"w": torch.zeros(512 * 1024)}  # 2 MiB: more than the memory tier holds
for step in range(2):
    state["w"].fill_(step)
    trainpod.report(step)
    if ck.due(step):
        ck.save(step, state)
assert ck.wait(60)
print("committed", ck.progress().committed, flush=True)
assert ck.close(60)
"""


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    try:
        with tmpfs(tmp_path / "shm", "1m") as mnt:
            yield mnt
    except TmpfsUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.timeout(240)  # 10-93 s measured at load 6-9
def test_a_full_memory_tier_sends_the_save_to_scratch_with_an_event(
    make_cluster: Callable[..., Cluster], small_shm: Path
) -> None:
    cluster = make_cluster(workers=1)
    (cluster.workdir / "train.py").write_text(SHM_FULL)
    job = cluster.submit(["python", "train.py", str(small_shm)], nodes=1, procs_per_node=1)
    done = cluster.wait_job(job.id, timeout_s=180)
    assert done.state == "completed", done.reason
    log = cluster.client.logs(job.id, rank=0).data
    assert "'memory': None, 'scratch': 1" in log and "'durable': 1" in log, log
    events = cluster.client.events(job_id=job.id)
    full = [e for e in events if e.kind == "checkpoint_tier_full"]
    assert [e.data["step"] for e in full] == [0, 1], full
    for e in full:
        assert (e.node, e.data["tier"], e.data["to"]) == ("workers-0", "memory", "scratch")
        assert e.data["reason"].startswith("ENOSPC"), e.data
        assert e.data["needed_bytes"] == 2 * MiB and e.data["free_bytes"] <= MiB, e.data
        assert e.data["path"].startswith(str(small_shm)), e.data
    saved = [(e.data["step"], e.data["tier"]) for e in events if e.kind == "checkpoint_saved"]
    assert saved == [(0, "scratch"), (1, "scratch")], saved
    committed = {(e.data["tier"], e.data["step"]) for e in events if e.kind.endswith("committed")}
    assert ("durable", 1) in committed, committed
    assert not list(small_shm.glob("**/step-*")), "no partial step left in the full tier"
    shown = cluster.cli("events", "--job", str(job.id)).stdout
    assert "checkpoint_tier_full" in shown and "to=scratch" in shown, shown
    shown = cluster.cli("show", str(job.id)).stdout
    assert "tier full    memory on workers-0: 2 steps (0-1) went to scratch (ENOSPC" in shown, shown
    assert "checkpoints  newest step by tier: scratch 1, " in shown and "durable 1" in shown, shown


KILLED_IN_HANDOFF = """\
import os, torch, trainpod

attempt = int(os.environ["TRAINPOD_ATTEMPT"])
ck = trainpod.Checkpointer(every=2)
state = {"w": torch.zeros(4096), "step": -1}
start = ck.load_latest(state)
print(f"attempt={attempt} start={start} tier={ck.last_load.tier} w={state['w'][0].item():g}",
      flush=True)
for step in range(0 if start is None else start + 1, 5):
    state["w"].fill_(step)
    state["step"] = step
    trainpod.report(step)
    if ck.due(step):
        ck.save(step, state)  # the agent dies in the hand-off of step 2 (attempt 1)
    if attempt == 1 and step == 2:
        ck.wait(120)  # not past this: the agent kills this rank
assert ck.close(60)
print(f"attempt={attempt} done", flush=True)
"""

ONE_NODE = """\
name: {name}
backend: local
instance_groups:
  - name: workers
    count: 1
    devices_per_node: 1
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 5
recovery:
  teardown_grace_s: 2
"""


@pytest.mark.timeout(240)  # 21-71 s measured at load 6-9
def test_an_agent_killed_in_a_hand_off_leaves_no_torn_commit_and_the_job_resumes(
    make_cluster_from_spec: Callable[[str], Cluster],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trigger = tmp_path / "die-in-handoff"
    trigger.write_text("2")
    monkeypatch.setenv(DIE_IN_HANDOFF_ENV, str(trigger))  # the agents inherit it
    cluster = make_cluster_from_spec(ONE_NODE)  # no spare: the job comes back to workers-0
    (cluster.workdir / "train.py").write_text(KILLED_IN_HANDOFF)
    job = cluster.submit(["python", "train.py"], nodes=1, procs_per_node=1, auto_resume=True)
    done = cluster.wait_job(job.id, timeout_s=200)
    assert done.state == "completed", done.reason
    assert not trigger.exists(), "the seam fired"
    assert [a.number for a in done.attempts] == [1, 2], done.attempts
    first = cluster.client.logs(job.id, rank=0, attempt=1).data
    assert "attempt=1 done" not in first, first  # killed with its agent
    # Step 2 was committed in memory before the hand-off: the last verified step, loaded.
    second = cluster.client.logs(job.id, rank=0, attempt=2).data
    assert "attempt=2 start=2 tier=memory w=2" in second and "attempt=2 done" in second, second
    durable = Path(cluster.record.checkpoint_uri.removeprefix("file://")) / f"job-{job.id}"
    steps = sorted(durable.glob("step-*"))
    torn = [d.name for d in steps if not (d / "manifest.json").exists()]
    assert steps and not torn, (steps, torn)
    assert (durable / "step-0000000002" / "manifest.json").exists()  # the persister finished it
    assert (durable / "step-0000000004" / "manifest.json").exists()

    def durable_commits() -> list[tuple[int | None, int]]:
        return [
            (e.attempt, e.data["step"])
            for e in cluster.client.events(job_id=job.id)
            if e.kind == "checkpoint_committed" and e.data["tier"] == "durable"
        ]

    # The dead agent's persister could not report step 2; the next persister of the job on
    # the node handed its journal to the new agent, so the commit is an event all the same.
    wait_until(
        lambda: (1, 2) in durable_commits() and (2, 4) in durable_commits(),
        timeout_s=60,
        what="durable commits of step 2 (attempt 1) and step 4 (attempt 2)",
    )
    assert len(durable_commits()) == len(set(durable_commits())), durable_commits()
    persist_logs = (cluster.paths.node_dir("workers-0") / "persist").glob("*.log")
    said = "\n".join(p.read_text(errors="replace") for p in persist_logs)
    assert "a predecessor could not deliver" in said, said[-3000:]
