"""First-in-first-out gang placement: a pure function over a snapshot.

Jobs are considered in submission order. A job that does not fit holds back every later
job that could use any of its partition's nodes (no backfill), so a large job is never
starved by a stream of small ones. Hot spares are never handed out here: they are kept
for recovery.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainpod.scheduler.base import (
    Hold,
    Place,
    QueuedJob,
    Scheduler,
    SchedulerDecision,
    Snapshot,
)


@dataclass(frozen=True)
class FreeNode:
    name: str
    group: str


@dataclass(frozen=True)
class Placement:
    job_id: int
    nodes: tuple[str, ...]


def place(queue: Sequence[QueuedJob], free: Sequence[FreeNode]) -> list[Placement]:
    """Return the placements to make now, in queue order. Free nodes keep their order."""
    return [Placement(d.job_id, d.nodes) for d in _plan(queue, free) if isinstance(d, Place)]


def _plan(queue: Sequence[QueuedJob], free: Sequence[FreeNode]) -> list[SchedulerDecision]:
    available = list(free)
    blocked: dict[str, int] = {}  # group -> the first job that holds it back
    out: list[SchedulerDecision] = []
    for job in queue:
        ahead = sorted({blocked[g] for g in job.groups if g in blocked})
        if ahead:
            for g in job.groups:
                blocked.setdefault(g, job.id)
            out.append(Hold(job.id, f"behind job {ahead[0]}, first in line for these nodes"))
            continue
        fits = [n for n in available if n.group in job.groups]
        if len(fits) < job.nodes:
            for g in job.groups:
                blocked.setdefault(g, job.id)
            out.append(
                Hold(
                    job.id,
                    f"waiting for nodes: needs {job.nodes}, {len(fits)} idle in its partition",
                )
            )
            continue
        chosen = fits[: job.nodes]
        taken = {n.name for n in chosen}
        available = [n for n in available if n.name not in taken]
        out.append(Place(job.id, tuple(n.name for n in chosen)))
    return out


class FifoScheduler(Scheduler):
    """The embedded backend's scheduler: FIFO gangs over the free, non-spare nodes."""

    def plan(self, snapshot: Snapshot) -> list[SchedulerDecision]:
        free = [FreeNode(n.name, n.group) for n in snapshot.free()]
        return _plan(snapshot.queue, free)


class AllocationScheduler(Scheduler):
    """An external scheduler (Slurm) chose the nodes: a queued job starts once enough of
    its own allocation's agents are idle, on the first ``nodes`` of them by name; the
    rest of the allocation stays the job's hot spares."""

    def plan(self, snapshot: Snapshot) -> list[SchedulerDecision]:
        out: list[SchedulerDecision] = []
        for job in snapshot.queue:
            pool = sorted(n.name for n in snapshot.nodes if n.allocation == job.id and n.free)
            if len(pool) >= job.nodes:
                out.append(Place(job.id, tuple(pool[: job.nodes]), job.requeued))
        return out
