"""FakeAgent reports what the real agent would (see trainpod.agent.launcher)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainpod.testing import FakeAgent, FakeClock, FakeGroup, make_config

from .conftest import Cluster


def test_make_config_names_nodes_and_partitions_like_a_cluster_spec(tmp_path: Path) -> None:
    root = tmp_path
    cfg = make_config(root, groups=[("workers", 2), FakeGroup("spares", 1, devices=4, spare=True)])
    assert [(d.name, d.group, d.spare, d.devices) for d in cfg.nodes] == [
        ("workers-0", "workers", False, 2),
        ("workers-1", "workers", False, 2),
        ("spares-0", "spares", True, 4),
    ]
    assert cfg.partitions == {"default": ["workers", "spares"]}
    assert cfg.default_partition == "default"
    assert cfg.checkpoint_for(3) == (
        f"file://{root / 'checkpoints'}/job-3",
        f"{root / 'checkpoints'}/job-3",
    )


def test_reports_follow_the_launcher(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=1, procs=2)
    c.controller.step()
    agent = c.agents["workers-0"]
    orders = agent.beat()
    assert agent.start_ranks(orders) == [0, 1]
    assert agent.start_ranks(orders) == []  # a launch order is obeyed once
    attempt_id = c.attempt_id(job)
    agent.exit_rank(attempt_id, 0, code=0, tail="not reported: rank 0 succeeded")
    agent.exit_rank(attempt_id, 1, code=2, tail="boom")
    with pytest.raises(ValueError, match="already ended"):
        agent.exit_rank(attempt_id, 1)
    with pytest.raises(KeyError):
        agent.exit_rank(attempt_id + 1, 0)
    (report,) = agent.reports()
    assert (report.attempt_id, report.job_id) == (attempt_id, job)
    assert [(r.state, r.exit_code, r.log_tail) for r in report.ranks] == [
        ("exited", 0, ""),
        ("exited", 2, "boom"),
    ]
    assert report.ranks[0].ended_at == c.clock.now()
    agent.beat()
    assert agent.reports() == []  # delivered, then forgotten
    assert agent.running_ranks(attempt_id) == []


def test_the_hash_is_sent_only_with_a_wait(cluster: Cluster) -> None:
    agent = cluster.agents["workers-0"]
    orders = agent.beat()
    assert agent.orders_hash == orders.hash
    assert agent.heartbeat().orders_hash is None
    assert agent.heartbeat(wait_s=5).orders_hash == orders.hash


def test_a_failed_lifecycle_comes_with_a_failed_script_by_default(cluster: Cluster) -> None:
    hb = cluster.agents["workers-0"].heartbeat(lifecycle="failed")
    assert hb.lifecycle.state == "failed"
    assert [(r.script, r.state) for r in hb.lifecycle.results] == [("setup.sh", "failed")]


def test_progress_beacons_ride_on_the_next_beats_with_their_age(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=1, procs=2)
    attempt_id = c.start(job)
    agent = c.agents["workers-0"]
    t0 = c.clock.now()
    agent.progress(attempt_id, 0, 10)
    c.clock.advance(2)
    agent.progress(attempt_id, 0, 12, checkpoint_step=11)  # 1 s per step, derived
    agent.progress(attempt_id, 1, 12, step_time_s=0.9, at=t0 + 1)
    c.clock.advance(3)
    (report,) = agent.reports()
    b0, b1 = report.beacons
    assert (b0.rank, b0.first_at, b0.last_at, b0.age_s) == (0, t0, t0 + 2, 3.0)
    assert (b0.first_step, b0.last_step, b0.steps, b0.step_time_s) == (10, 12, 2, 1.0)
    assert b0.last_checkpoint_step == 11
    assert (b1.rank, b1.age_s, b1.step_time_s, b1.steps) == (1, 4.0, 0.9, 1)
    with pytest.raises(KeyError):
        agent.progress(attempt_id, 2, 1)  # rank 2 does not run here
    agent.exit_all(attempt_id)
    agent.beat()
    assert agent.reports() == []  # forgotten with the ranks


def test_the_agent_clock_can_be_its_own(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=1, procs=1)
    c.controller.step()
    own = FakeClock(5_000.0)
    agent = FakeAgent(c.controller, "workers-0", agent_id=c.agents["workers-0"].agent_id, clock=own)
    agent.start_ranks(agent.beat())
    attempt_id = c.attempt_id(job)
    agent.progress(attempt_id, 0, 1)
    own.advance(7)
    hb = agent.heartbeat()
    assert hb.time == 5_007.0
    assert (hb.attempts[0].beacons[0].last_at, hb.attempts[0].beacons[0].age_s) == (5_000.0, 7.0)
    assert agent.restarted().clock is own


def test_health_and_deep_check_results_are_sent_with_every_beat(cluster: Cluster) -> None:
    agent = cluster.agents["workers-0"]
    assert agent.heartbeat().health == [] and agent.heartbeat().deep_check is None
    agent.set_health("gpu", "ok", "4 GPUs healthy")
    agent.set_health("disk", "warn", "scratch 91% full")
    assert [(h.check, h.status) for h in agent.heartbeat().health] == [
        ("disk", "warn"),
        ("gpu", "ok"),
    ]
    agent.set_health("gpu", "fault", "XID 79")
    assert [h.status for h in agent.heartbeat().health] == ["warn", "fault"]
    with pytest.raises(ValueError, match="no deep check order"):
        agent.deep_check_result()
    agent.deep_check_result("abc", "fault", "GEMM mismatch")
    dc = agent.heartbeat().deep_check
    assert dc is not None and (dc.id, dc.status, dc.reason) == ("abc", "fault", "GEMM mismatch")


def test_make_config_takes_the_recovery_settings(tmp_path: Path) -> None:
    cfg = make_config(
        tmp_path,
        hang_timeout_s=30,
        straggler_factor=2.0,
        straggler_checks=4,
        auto_repair=False,
        retire_after=2,
        deep_check_timeout_s=60,
    )
    assert (cfg.hang_timeout_s, cfg.straggler_factor, cfg.straggler_checks) == (30, 2.0, 4)
    assert (cfg.auto_repair, cfg.retire_after, cfg.deep_check_timeout_s) == (False, 2, 60)


def test_a_pid_reported_after_the_rank_ran_is_recorded(cluster: Cluster) -> None:
    """The launcher lists every rank of an attempt before it spawns the first, so a rank may
    be reported running with no pid; its pid, in a later report, is kept (it was not: the
    real Slurm's torchrun test found rank 1 running with no pid to signal)."""
    c = cluster
    job = c.submit(nodes=1, procs=2)
    c.controller.step()
    agent = c.agents["workers-0"]
    agent.start_ranks(agent.beat())
    attempt_id = c.attempt_id(job)
    pid = agent.pid(attempt_id, 1)
    agent.set_pid(attempt_id, 1, None)
    agent.beat()
    ranks = {r.rank: r for r in c.controller.job_info(job).attempts[0].ranks}
    assert ranks[1].state == "running" and ranks[1].pid is None
    assert ranks[0].pid == agent.pid(attempt_id, 0)
    agent.set_pid(attempt_id, 1, pid)
    agent.beat()
    ranks = {r.rank: r for r in c.controller.job_info(job).attempts[0].ranks}
    assert ranks[1].pid == pid
