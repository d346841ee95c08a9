"""Scheduling passes: a snapshot of the queue, the running jobs and the nodes, handed to
the scheduler; its decisions go to the executor.

A pass runs when something changed since the last one, or once the time the scheduler
asked for (:meth:`~trainpod.scheduler.base.Scheduler.wake_at`) has come.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from trainpod.controller.config import ControllerConfig
from trainpod.controller.executor import Executor
from trainpod.controller.external import Scheduling
from trainpod.controller.sharing import Shapes, UsageBook
from trainpod.controller.transitions import Transitions
from trainpod.model.states import AttemptState, JobState
from trainpod.scheduler.base import QueuedJob, RunningJob, Snapshot, still_lending
from trainpod.store.repo import Store
from trainpod.telemetry.tally import PASS_BUCKETS, Histogram


@dataclass
class Planner:
    store: Store
    cfg: ControllerConfig
    tx: Transitions
    scheduling: Scheduling
    executor: Executor
    _shapes: Shapes = field(init=False)
    """Queued and running jobs as the scheduler sees them, parsed once per job."""
    _usage_book: UsageBook = field(init=False)
    _planned_at: tuple[int, float | None] = field(default=(-1, None), init=False)
    """(version, wake_at) of the last pass."""
    passes: Histogram = field(default_factory=lambda: Histogram(PASS_BUCKETS), init=False)
    """How long passes took (real time; for ``/metrics``)."""

    def __post_init__(self) -> None:
        self._shapes = Shapes(self.cfg, self.tx)
        self._usage_book = UsageBook(self.store, self.cfg.fair_share_half_life_s)

    def due(self, now: float) -> bool:
        version, wake_at = self._planned_at
        return version != self.tx.wake.version or (wake_at is not None and now >= wake_at)

    def run(self, now: float) -> Snapshot | None:
        """One pass if one is due; the snapshot it planned over (None: none was due)."""
        if not self.due(now):
            return None
        began = time.perf_counter()
        snapshot = self.snapshot(now)
        scheduler = self.scheduling.scheduler
        if self.executor.schedule(scheduler.plan(snapshot), now):
            self.tx.wake.bump()
        self._planned_at = (self.tx.wake.version, scheduler.wake_at(snapshot))
        self.passes.observe(time.perf_counter() - began)
        return snapshot

    def snapshot(self, now: float) -> Snapshot:
        waiting = self.store.jobs([JobState.QUEUED, JobState.PREEMPTED])
        queued = [j for j in waiting if not j.held_by]  # held jobs wait for `trainpod release`
        earlier = self.store.attempts_of_jobs([j.id for j in queued])
        active = self.store.active_attempts()
        jobs = {j.id: j for j in queued}
        others = self.store.jobs_by_id([a.job_id for a in active if a.job_id not in jobs])
        jobs.update((j.id, j) for j in others)
        self._shapes.keep_only(set(jobs))
        queue = []
        queued_since = {
            j.id: max([j.submitted_at, *(a.ended_at for a in earlier[j.id] if a.ended_at)])
            for j in queued
        }
        for job in queued:
            s = self._shapes.of(job)
            queue.append(
                QueuedJob(
                    id=job.id,
                    nodes=s.nodes,
                    groups=s.groups,
                    submitted_at=job.submitted_at,
                    requeued=f"requeued: {job.reason}" if earlier[job.id] else "",
                    partition=s.partition,
                    team=s.team,
                    user=s.user,
                    priority=s.priority,
                    priority_class=s.priority_class,
                    preemptible=s.preemptible,
                    time_limit_s=s.time_limit_s,
                    interactive=s.interactive,
                )
            )
        saved = self.store.last_checkpoints([a.job_id for a in active])
        running = []
        for a in active:
            s = self._shapes.of(jobs[a.job_id])
            running.append(
                RunningJob(
                    id=a.job_id,
                    attempt=a.id,
                    nodes=tuple(a.nodes),
                    started_at=a.started_at,
                    partition=s.partition,
                    team=s.team,
                    user=s.user,
                    priority=s.priority,
                    priority_class=s.priority_class,
                    preemptible=s.preemptible,
                    time_limit_s=s.time_limit_s,
                    last_checkpoint_at=saved.get(a.job_id),
                    stopping=a.state is AttemptState.STOPPING,
                    lent_by=still_lending(a.lent_by, a.created_at, queued_since),
                )
            )
        rows = sorted(self.store.nodes(), key=self.tx.node_order)
        return Snapshot(
            now=now,
            queue=tuple(queue),
            running=tuple(running),
            nodes=tuple(self.scheduling.slot(n) for n in rows),
            usage=self._usage(now),
        )

    def _usage(self, now: float) -> dict[str, float]:
        return self._usage_book.usage(now)
