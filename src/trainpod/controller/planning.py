"""Scheduling passes: a snapshot of the queue, the running jobs and the nodes, handed to
the scheduler; its decisions go to the executor.

A pass runs when something changed since the last one, or once the time the scheduler
asked for (:meth:`~trainpod.scheduler.base.Scheduler.wake_at`) has come.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainpod.controller.config import ControllerConfig
from trainpod.controller.executor import Executor
from trainpod.controller.external import Scheduling
from trainpod.controller.transitions import Transitions
from trainpod.model.states import JobState
from trainpod.scheduler.base import QueuedJob, RunningJob, Snapshot
from trainpod.store.repo import Store


@dataclass
class Planner:
    store: Store
    cfg: ControllerConfig
    tx: Transitions
    scheduling: Scheduling
    executor: Executor
    _shapes: dict[int, tuple[int, frozenset[str]]] = field(default_factory=dict, init=False)
    """Queued job -> (nodes, groups), parsed once per job."""
    _planned_at: tuple[int, float | None] = field(default=(-1, None), init=False)
    """(version, wake_at) of the last pass."""

    def due(self, now: float) -> bool:
        version, wake_at = self._planned_at
        return version != self.tx.wake.version or (wake_at is not None and now >= wake_at)

    def run(self, now: float) -> Snapshot | None:
        """One pass if one is due; the snapshot it planned over (None: none was due)."""
        if not self.due(now):
            return None
        snapshot = self.snapshot(now)
        scheduler = self.scheduling.scheduler
        if self.executor.schedule(scheduler.plan(snapshot), now):
            self.tx.wake.bump()
        self._planned_at = (self.tx.wake.version, scheduler.wake_at(snapshot))
        return snapshot

    def snapshot(self, now: float) -> Snapshot:
        queued = self.store.jobs([JobState.QUEUED, JobState.PREEMPTED])
        ids = {j.id for j in queued}
        for stale in set(self._shapes) - ids:
            del self._shapes[stale]
        earlier = self.store.attempts_of_jobs([j.id for j in queued])
        queue = []
        for job in queued:
            shape = self._shapes.get(job.id)
            if shape is None:
                spec = self.tx.spec(job)
                part = spec.partition or self.cfg.default_partition
                shape = (spec.nodes, frozenset(self.cfg.partitions.get(part, [])))
                self._shapes[job.id] = shape
            queue.append(
                QueuedJob(
                    id=job.id,
                    nodes=shape[0],
                    groups=shape[1],
                    submitted_at=job.submitted_at,
                    requeued=f"requeued: {job.reason}" if earlier[job.id] else "",
                )
            )
        running = tuple(
            RunningJob(id=a.job_id, attempt=a.id, nodes=tuple(a.nodes), started_at=a.started_at)
            for a in self.store.active_attempts()
        )
        rows = sorted(self.store.nodes(), key=self.tx.node_order)
        return Snapshot(
            now=now,
            queue=tuple(queue),
            running=running,
            nodes=tuple(self.scheduling.slot(n) for n in rows),
        )
