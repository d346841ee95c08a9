"""Agents' checkpoint reports become events once each; orders say which jobs keep their
shared memory on a node."""

from __future__ import annotations

from typing import Any

from trainpod.api.models import CheckpointReport, CheckpointUpload

from .conftest import Cluster


def report(c: Cluster, node: str, *reports: CheckpointReport, **hb: Any) -> None:
    agent = c.agents[node]
    beat = agent.heartbeat().model_copy(update={"checkpoints": list(reports), **hb})
    c.controller.heartbeat(beat)


def rep(job: int, attempt: int, step: int, tier: str, **kw: Any) -> CheckpointReport:
    kw.setdefault("ok", True)
    kw.setdefault("scope", "job" if tier == "durable" else "node")
    return CheckpointReport(job_id=job, attempt_id=attempt, step=step, tier=tier, **kw)


def test_reports_become_events_once_each(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=2, procs=1)
    attempt = c.start(job)
    saved = rep(job, attempt, 4, "memory", saved=True, stall_s=0.2, bytes=100)
    for node in ("workers-0", "workers-1"):  # every node leader's agent reports the save
        report(c, node, saved, rep(job, attempt, 4, "scratch", bytes=50, seconds=0.1))
        report(c, node, rep(job, attempt, 4, "durable", bytes=100, wrote_manifest=True))
    report(c, "workers-0", rep(job, attempt, 4, "scratch"))  # delivered twice
    failed = rep(job, attempt, 6, "durable", ok=False, reason="ConnectionError: down")
    report(c, "workers-1", failed, failed)
    report(c, "workers-1", rep(job + 1, attempt, 8, "durable"))  # no such job: ignored

    ((s,),) = [c.events("checkpoint_saved")]
    assert (s.job_id, s.attempt, s.node, s.data["step"], s.data["stall_s"]) == (
        job, 1, None, 4, 0.2,
    )  # fmt: skip
    committed = [(e.node, e.data["tier"], e.data["step"]) for e in c.events("checkpoint_committed")]
    assert committed == [
        ("workers-0", "scratch", 4),
        (None, "durable", 4),
        ("workers-1", "scratch", 4),
    ]
    (f,) = c.events("checkpoint_failed")
    assert (f.node, f.data["tier"], f.data["step"], f.data["reason"]) == (
        "workers-1", "durable", 6, "ConnectionError: down",
    )  # fmt: skip

    # A restarted controller reads what it wrote and still writes nothing twice.
    c.restart_controller()
    c.up()
    report(c, "workers-1", failed, rep(job, attempt, 4, "durable"))
    assert len(c.events("checkpoint_failed")) == 1 and len(c.events("checkpoint_committed")) == 3


def test_a_node_that_never_ran_the_job_cannot_report_for_it(make_cluster: Any) -> None:
    c = make_cluster(groups=[("workers", 3)])
    c.up()
    job = c.submit(nodes=1, procs=1)
    attempt = c.start(job)
    (ran,) = c.job(job).attempts[0].nodes
    other = next(n for n in c.agents if n != ran)
    report(c, other, rep(job, attempt, 2, "durable"))
    assert c.events("checkpoint_committed") == []


def test_upload_progress_shows_in_the_jobs_live_progress(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=1, procs=1)
    c.start(job)
    (node,) = c.job(job).attempts[0].nodes
    up = CheckpointUpload(job_id=job, copying_step=4, copying_tier="durable", bytes_done=10)
    report(c, node, checkpoint_uploads=[up])
    progress = c.job(job).progress
    assert progress is not None
    assert progress["checkpoint_uploads"][node]["bytes_done"] == 10


def test_orders_list_the_jobs_whose_memory_stays_on_the_node(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=1, procs=1)
    attempt = c.start(job)
    (node,) = c.job(job).attempts[0].nodes
    other = next(n for n in c.agents if n != node)
    orders = c.beat()
    assert orders[node].active_jobs == [job] and orders[other].active_jobs == []
    c.agents[node].exit_all(attempt)
    c.beat(node)
    assert c.job(job).state == "completed"
    assert c.beat(node)[node].active_jobs == []


def test_the_steps_a_slow_tier_skipped_show_in_its_events_and_live_progress(
    cluster: Cluster,
) -> None:
    c = cluster
    job = c.submit(nodes=1, procs=1)
    attempt = c.start(job)
    (node,) = c.job(job).attempts[0].nodes
    report(c, node, rep(job, attempt, 4, "durable"), rep(job, attempt, 9, "durable", skipped=4))
    skipped = [(e.data["step"], e.data.get("skipped")) for e in c.events("checkpoint_committed")]
    assert skipped == [(4, None), (9, 4)]  # written only when some step was skipped
    up = CheckpointUpload(job_id=job, committed={"durable": 9}, steps_skipped={"durable": 4})
    report(c, node, checkpoint_uploads=[up])
    progress = c.job(job).progress
    assert progress is not None
    assert progress["checkpoint_uploads"][node]["steps_skipped"] == {"durable": 4}


def test_a_full_tier_is_an_event_once_and_counted_by_tier(cluster: Cluster) -> None:
    from trainpod.telemetry.tally import UNKNOWN, EventTally

    c = cluster
    job = c.submit(nodes=2, procs=1)
    attempt = c.start(job)
    full = rep(
        job, attempt, 3, "memory", ok=False, full=True, to_tier="scratch", path="/dev/shm/x",
        needed_bytes=2048, free_bytes=10, reason="ENOSPC: not enough free space",
    )  # fmt: skip
    report(c, "workers-0", full, full)  # delivered twice
    (e,) = c.events("checkpoint_tier_full")
    assert (e.node, e.attempt, e.data["step"], e.data["tier"], e.data["to"]) == (
        "workers-0", 1, 3, "memory", "scratch",
    )  # fmt: skip
    assert (e.data["needed_bytes"], e.data["free_bytes"], e.data["path"]) == (
        2048,
        10,
        "/dev/shm/x",
    )
    assert c.events("checkpoint_failed") == [] and c.events("checkpoint_committed") == []
    tally = EventTally()
    tally.seed([], ["memory", "scratch"], [], [])
    tally.fold(c.controller.store.typed_events(job_id=job), lambda _job: UNKNOWN)
    assert tally.full == {"memory": 1, "scratch": 0}
