"""The scheduler seam: plan(snapshot) -> Place | Hold | Preempt, applied by the executor
that runs recovery; run on change and on time."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainpod.scheduler.base import (
    Hold,
    Place,
    Preempt,
    RunningJob,
    Scheduler,
    SchedulerDecision,
    Snapshot,
)
from trainpod.scheduler.fifo import FifoScheduler

from .conftest import Cluster, MakeCluster


def test_queued_jobs_show_why_they_wait(cluster: Cluster) -> None:
    first = cluster.submit(nodes=2)
    second = cluster.submit(nodes=2)
    third = cluster.submit(nodes=1)
    cluster.controller.step()
    assert cluster.job(first).state == "starting"
    assert cluster.job(first).reason == ""
    assert cluster.job(second).reason == "waiting for nodes: needs 2, 0 idle in partition default"
    assert cluster.job(third).reason == "waiting for nodes: needs 1, 0 idle in partition default"
    assert [cluster.job(j).queue_position for j in (first, second, third)] == [None, 1, 2]
    assert [j.reason for j in cluster.controller.job_infos(include_ended=False)][1:] == [
        cluster.job(second).reason,
        cluster.job(third).reason,
    ]


@dataclass
class PreemptFor(Scheduler):
    """Urgent jobs first: one waiting preempts every running job; then FIFO, urgent first."""

    grace_s: float = 7.0
    snapshots: list[Snapshot] = field(default_factory=list)

    def plan(self, snapshot: Snapshot) -> list[SchedulerDecision]:
        self.snapshots.append(snapshot)
        urgent = [q for q in snapshot.queue if q.id in self.urgent]
        if urgent and snapshot.running:
            return [
                Preempt(r.id, "an urgent job needs the nodes", self.grace_s)
                for r in snapshot.running
            ]
        first = sorted(snapshot.queue, key=lambda q: q.id not in self.urgent)
        return FifoScheduler().plan(replace(snapshot, queue=tuple(first)))

    urgent: set[int] = field(default_factory=set)


def test_a_preempted_job_gets_its_grace_period_is_queued_again_and_resumes(
    make_cluster: MakeCluster,
) -> None:
    policy = PreemptFor()
    c = make_cluster(scheduler=policy)
    c.up()
    low = c.submit(nodes=2)
    c.start(low)
    assert c.job(low).state == "running"
    assert policy.snapshots[-1].running == ()  # the snapshot before it was placed
    urgent = c.submit(nodes=2)
    policy.urgent.add(urgent)
    c.controller.step()
    running: tuple[RunningJob, ...] = policy.snapshots[-1].running
    assert [(r.id, r.nodes) for r in running] == [(low, ("workers-0", "workers-1"))]

    info = c.job(low)
    assert (info.state, info.attempts[0].state, info.attempts[0].cause) == (
        "stopping",
        "stopping",
        "preempted",
    )
    orders = c.beat("workers-0")["workers-0"]
    (kill,) = orders.kill  # the notice, the policy's grace, then the usual teardown
    assert (kill.notice_signal, kill.notice_grace_s, kill.reason) == ("SIGUSR1", 7.0, "preempted")
    assert kill.grace_s == c.controller.cfg.teardown_grace_s
    (preempted,) = c.events("job_preempted", job_id=low)
    assert preempted.data["reason"] == "an urgent job needs the nodes"
    assert not c.events("fault_detected", job_id=low)  # a preemption is not a fault

    for name in ("workers-0", "workers-1"):
        agent = c.agents[name]
        agent.kill_ranks(agent.beat())
        agent.beat()
    info = c.job(low)  # the report that freed the nodes placed the urgent job at once
    assert (info.state, c.job(urgent).state) == ("preempted", "starting")
    assert info.reason.endswith("preempted: an urgent job needs the nodes")
    assert (info.attempts[0].state, info.attempts[0].cause) == ("failed", "preempted")
    assert not c.events("recovery_decision", job_id=low)  # requeued, not recovered

    c.controller.step()
    assert c.job(urgent).state == "starting"
    assert c.job(low).state == "preempted"  # waiting again, in the queue the planner reads
    attempt = c.start(urgent)
    for name in ("workers-0", "workers-1"):
        c.agents[name].exit_all(attempt)
        c.agents[name].beat()
    assert c.job(urgent).state == "completed"
    c.controller.step()
    info = c.job(low)
    assert (info.state, len(info.attempts)) == ("starting", 2)  # back, on a new attempt


@dataclass
class NotBefore(Scheduler):
    """Holds every job until ``at``, then places FIFO: a policy that acts on time alone."""

    at: float
    passes: int = 0

    def plan(self, snapshot: Snapshot) -> list[SchedulerDecision]:
        self.passes += 1
        if snapshot.now < self.at:
            return [Hold(q.id, f"held until t={self.at:g}") for q in snapshot.queue]
        return FifoScheduler().plan(snapshot)

    def wake_at(self, snapshot: Snapshot) -> float | None:
        return self.at if snapshot.now < self.at else None


def test_the_scheduler_runs_on_time_as_well_as_on_change(make_cluster: MakeCluster) -> None:
    c = make_cluster(scheduler=NotBefore(at=0.0), heartbeat_timeout_s=600)
    policy = c.scheduler
    assert isinstance(policy, NotBefore)
    policy.at = c.clock.now() + 30
    c.up()
    job = c.submit(nodes=1)
    c.controller.step()
    assert (c.job(job).state, c.job(job).reason) == ("queued", f"held until t={policy.at:g}")
    passes = policy.passes
    c.controller.step()
    assert policy.passes == passes  # nothing changed and its time has not come: no pass
    c.clock.advance(31)
    c.controller.step()  # no agent beat, no submission: only the clock moved
    assert c.job(job).state == "starting"
    assert isinstance(policy.plan(c.controller.planner.snapshot(c.clock.now())), list)


def test_place_decisions_go_through_the_executor_with_their_nodes(cluster: Cluster) -> None:
    job = cluster.submit(nodes=1)
    snapshot = cluster.controller.planner.snapshot(cluster.clock.now())
    assert [q.id for q in snapshot.queue] == [job]
    assert [n.name for n in snapshot.free()] == ["workers-0", "workers-1"]
    assert FifoScheduler().plan(snapshot) == [Place(job, ("workers-0",))]
