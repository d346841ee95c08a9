"""Snapshots for the scheduler's pure functions, in a line each: a cluster of free or busy
nodes, queued and running jobs with their team and priority, decisions grouped by kind.

For the scheduler's own tests and for users who write a policy and want to test it the same
way (``SharedScheduler(policy).plan(snapshot(...), now)``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from trainpod.scheduler.base import (
    Hold,
    NodeSlot,
    Place,
    QueuedJob,
    RunningJob,
    SchedulerDecision,
    Snapshot,
)
from trainpod.scheduler.policy import SharingPolicy, TeamPolicy

GPU = frozenset({"gpu"})
HIGH, NORMAL, LOW = 100, 10, 1
CLASS = {HIGH: "high", NORMAL: "normal", LOW: "low"}


def cluster(n: int, group: str = "gpu", busy: Sequence[str] = ()) -> list[NodeSlot]:
    return [NodeSlot(f"{group}-{i}", group, free=f"{group}-{i}" not in busy) for i in range(n)]


def queued(
    id: int,
    nodes: int,
    team: str = "",
    priority: int = NORMAL,
    at: float = 0.0,
    limit: float | None = None,
    groups: frozenset[str] = GPU,
) -> QueuedJob:
    return QueuedJob(
        id=id,
        nodes=nodes,
        groups=groups,
        submitted_at=at,
        partition="gpu",
        team=team,
        priority=priority,
        priority_class=CLASS.get(priority, ""),
        time_limit_s=limit,
    )


def running(
    id: int,
    nodes: Sequence[str],
    team: str = "",
    priority: int = NORMAL,
    started: float = 0.0,
    limit: float | None = None,
    checkpoint: float | None = None,
    preemptible: bool = True,
    stopping: bool = False,
) -> RunningJob:
    return RunningJob(
        id=id,
        attempt=id * 10,
        nodes=tuple(nodes),
        started_at=started,
        partition="gpu",
        team=team,
        priority=priority,
        priority_class=CLASS.get(priority, ""),
        preemptible=preemptible,
        time_limit_s=limit,
        last_checkpoint_at=checkpoint,
        stopping=stopping,
    )


def snapshot(
    now: float,
    queue: Sequence[QueuedJob],
    run: Sequence[RunningJob] = (),
    nodes: Sequence[NodeSlot] | None = None,
    usage: Mapping[str, float] | None = None,
    size: int = 4,
) -> Snapshot:
    if nodes is None:
        held = [n for r in run for n in r.nodes]
        nodes = cluster(size, busy=held)
    return Snapshot(now, tuple(queue), tuple(run), tuple(nodes), dict(usage or {}))


def by_kind(decisions: Sequence[SchedulerDecision]) -> dict[str, dict[int, object]]:
    out: dict[str, dict[int, object]] = {"place": {}, "hold": {}, "preempt": {}}
    for d in decisions:
        if isinstance(d, Place):
            out["place"][d.job_id] = d.nodes
        elif isinstance(d, Hold):
            out["hold"][d.job_id] = d.reason
        else:
            out["preempt"][d.job_id] = d.reason
    return out


def holds(decisions: Sequence[SchedulerDecision]) -> dict[int, Hold]:
    return {d.job_id: d for d in decisions if isinstance(d, Hold)}


def teams(
    *ts: TeamPolicy, half_life_s: float = 7 * 86400.0, min_run_s: float = 0.0
) -> SharingPolicy:
    return SharingPolicy(teams=ts, half_life_s=half_life_s, min_run_s=min_run_s)
