"""FakeAgent reports what the real agent would (see trainpod.agent.launcher)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainpod.testing import FakeGroup, make_config

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
