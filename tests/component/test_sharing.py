"""The shared-cluster policy as the controller applies it: a real controller and store, fake
agents, a fake clock. Quotas, borrowing and reclaim, priority preemption with the notice,
positions; the policy's own cases are in tests/unit/test_shared_scheduler.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from trainpod.controller.access import Principal
from trainpod.controller.config import PreemptionConfig
from trainpod.errors import Conflict, Forbidden
from trainpod.scheduler.policy import DEFAULT_MIN_RUN_S
from trainpod.spec.job import JobSpec
from trainpod.spec.sharing import PriorityClassSpec, QuotaAmount, TeamSpec
from trainpod.testing import FakeClock, FakeGroup, make_config

from .conftest import Cluster

ALICE = Principal("alice", "user", team="vision")
BOB = Principal("bob", "user", team="nlp")


def shared_cluster(tmp_path: Path, *, nlp_lends: bool = True, nodes: int = 2) -> Cluster:
    cfg = dataclasses.replace(
        make_config(tmp_path, groups=(FakeGroup("workers", nodes),)),
        priority_classes=(
            PriorityClassSpec(name="high", value=1000, preemptible=False),
            PriorityClassSpec(name="normal", value=100, default=True),
            PriorityClassSpec(name="low", value=10),
        ),
        teams=(
            TeamSpec(name="vision", quota={"default": QuotaAmount(nodes=1)}),
            TeamSpec(name="nlp", quota={"default": QuotaAmount(nodes=1)}, lend=nlp_lends),
        ),
        team_quotas={"vision": {"default": 1}, "nlp": {"default": 1}},
        preemption=PreemptionConfig(signal="SIGUSR1", grace_s=20.0),
    )
    c = Cluster(cfg, tmp_path / "state.db", FakeClock())
    c.up()
    return c


def submit(c: Cluster, who: Principal, **kw: Any) -> int:
    spec = JobSpec(command=["python", "train.py"], nodes=1, procs_per_node=1, **kw)
    return c.controller.submit(spec, by=who)


def age(c: Cluster, seconds: float) -> None:
    """Let time pass with every agent beating (silent nodes would be lost)."""
    for _ in range(int(seconds // 2)):
        c.clock.advance(2)
        c.beat()
    c.controller.step()


def test_a_team_stops_at_its_quota_when_others_do_not_lend(tmp_path: Path) -> None:
    c = shared_cluster(tmp_path, nlp_lends=False)
    first, second = submit(c, ALICE), submit(c, ALICE)
    c.start(first)
    assert c.job(second).state == "queued"
    assert "waiting for quota" in c.job(second).reason
    assert "vision" in c.job(second).reason
    assert c.job(second).queue_position == 1
    # Another team's job takes the idle node: GPUs are not left idle while work waits.
    theirs = submit(c, BOB)
    c.start(theirs)
    assert c.job(theirs).state in ("starting", "running")


def test_borrowing_then_reclaim_preempts_the_borrower_with_the_notice(tmp_path: Path) -> None:
    c = shared_cluster(tmp_path)
    first, borrowed = submit(c, ALICE), submit(c, ALICE)
    c.start(first)
    age(c, 10)
    c.start(borrowed)  # nlp's idle quota, lent; it has run less, so it loses less
    assert c.job(borrowed).state == "running"
    age(c, DEFAULT_MIN_RUN_S + 10)  # past the minimum run: the borrower may be a victim
    theirs = submit(c, BOB)  # nlp wants its node back
    c.controller.step()
    [preempted] = c.events("job_preempted")
    assert preempted.job_id == borrowed
    assert "reclaimed" in preempted.data["reason"]
    borrower_node = c.job(borrowed).attempts[-1].nodes[0]
    orders = c.agents[borrower_node].beat()
    [kill] = orders.kill
    assert (kill.notice_signal, kill.notice_grace_s) == ("SIGUSR1", 20.0)
    assert "waiting for job" in c.job(theirs).reason  # its node is reserved for it
    c.agents[borrower_node].kill_ranks(orders)
    c.agents[borrower_node].beat()
    c.controller.step()
    assert c.job(borrowed).state == "preempted"
    assert not c.events("fault_detected")
    c.start(theirs)
    assert c.job(theirs).attempts[-1].nodes == [borrower_node]


def test_a_higher_class_preempts_the_lower_job_that_loses_least_work(tmp_path: Path) -> None:
    c = shared_cluster(tmp_path, nodes=2)
    old, recent = submit(c, BOB, priority_class="low"), submit(c, ALICE, priority_class="low")
    c.start(old)
    c.start(recent)
    age(c, DEFAULT_MIN_RUN_S + 10)
    # `recent` committed a checkpoint a moment ago: preempting it loses the least.
    c.controller.store.add_event(
        c.clock.now() - 1, "checkpoint_committed", job_id=recent, step=10, tier="durable"
    )
    urgent = submit(c, ALICE, priority_class="high")
    c.controller.step()
    [preempted] = c.events("job_preempted")
    assert preempted.job_id == recent
    assert f"job {urgent}" in preempted.data["reason"]
    assert c.job(old).state == "running"


def test_by_default_a_job_inside_its_minimum_run_is_no_victim_until_that_ends(
    tmp_path: Path,
) -> None:
    c = shared_cluster(tmp_path, nodes=1)
    assert c.controller.cfg.preemption.min_run_s == DEFAULT_MIN_RUN_S  # nothing set: the default
    low = submit(c, ALICE, priority_class="low")  # her own lower work: a victim but for its age
    c.start(low)
    age(c, 30)
    urgent = submit(c, ALICE, priority_class="high")
    c.controller.step()
    assert not c.events("job_preempted")  # 30 s in: a victim now would thrash
    assert c.job(low).state == "running"
    assert f"waiting for job {low}'s minimum run time" in c.job(urgent).reason
    age(c, DEFAULT_MIN_RUN_S - 30 + 4)
    [preempted] = c.events("job_preempted")
    assert preempted.job_id == low and f"job {urgent}" in preempted.data["reason"]


def test_a_job_past_its_time_limit_is_stopped_and_fails_with_the_reason(tmp_path: Path) -> None:
    c = shared_cluster(tmp_path)
    job = submit(c, ALICE, time_limit="1")  # one minute, Slurm's format
    c.start(job)
    age(c, 30)
    assert c.job(job).state == "running"
    age(c, 40)
    [kill] = [k for o in c.beat().values() for k in o.kill]
    assert kill.reason == "time_limit"
    for agent in c.agents.values():
        agent.kill_ranks()
        agent.beat()
    c.controller.step()
    info = c.job(job)
    assert info.state == "failed" and info.reason.startswith("time limit 1 reached")
    assert info.attempts[-1].cause == "time_limit"
    assert not c.events("fault_detected") and not c.events("recovery_decision")
    assert c.node_states() == {"workers-0": "idle", "workers-1": "idle"}


def test_a_held_job_is_skipped_and_says_so_until_its_owner_releases_it(tmp_path: Path) -> None:
    c = shared_cluster(tmp_path, nodes=1)
    running, held, after = submit(c, ALICE), submit(c, ALICE), submit(c, BOB)
    c.start(running)
    with pytest.raises(Forbidden, match="bob may not hold or release job"):
        c.controller.hold(held, BOB)
    c.controller.hold(held, ALICE)
    c.controller.hold(held, ALICE)  # again: nothing changes
    c.controller.step()
    assert [e.job_id for e in c.events("job_held")] == [held]
    info = c.job(held)
    assert info.state == "queued" and info.reason.startswith("held by alice")
    assert f"trainpod release {held}" in info.reason and info.queue_position is None
    assert c.job(after).queue_position == 1  # the held job keeps nobody waiting
    with pytest.raises(Conflict, match="only a waiting job can be held"):
        c.controller.hold(running, ALICE)
    c.controller.hold(held, Principal("root", "admin"), release=True)
    c.controller.step()
    assert c.job(held).queue_position is not None
    assert [e.data["by"] for e in c.events("job_released")] == ["root"]
