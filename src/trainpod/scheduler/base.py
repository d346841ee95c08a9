"""The scheduler seam: a pure ``plan(snapshot) -> decisions`` over the whole cluster.

A :class:`Snapshot` holds the queue (in submission order), the running jobs and every node,
so policies that need more than the queue (preemption, backfill, quotas) are plain
functions over it. A scheduler returns decisions; it never touches a store. The controller's
executor (the one that also runs the recovery ladder's decisions) applies them:

* :class:`Place` — start the job's next attempt on these nodes now;
* :class:`Hold` — leave it queued, with the reason its owner sees in ``trainpod jobs``;
* :class:`Preempt` — stop a running job (its ranks get ``grace_s`` to checkpoint) and queue
  it again.

The controller calls :meth:`Scheduler.plan` whenever something changed, and also once the
time a scheduler asks for in :meth:`Scheduler.wake_at` has come (aging, deadlines, grace
periods), so a policy can act on time alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class QueuedJob:
    id: int
    nodes: int
    groups: frozenset[str]  # the groups of its partition
    submitted_at: float = 0.0
    requeued: str = ""  # why an earlier attempt ended (a requeue): the restart's reason
    partition: str = ""  # the partition's name (quotas are per team per partition)
    team: str = ""  # the owner's team
    user: str = ""  # the owner
    priority: int = 0  # its priority class's value: higher runs first
    priority_class: str = ""  # that class's name, for reasons
    preemptible: bool = True  # may be stopped for higher work once it runs
    time_limit_s: float | None = None  # declared run time (--time); None: unknown
    interactive: bool = False  # an allocation a person works in: never on lent nodes


@dataclass(frozen=True)
class RunningJob:
    id: int
    attempt: int  # the running attempt's id
    nodes: tuple[str, ...]
    started_at: float | None = None  # None: still starting
    partition: str = ""
    team: str = ""
    user: str = ""
    priority: int = 0
    priority_class: str = ""
    preemptible: bool = True
    time_limit_s: float | None = None
    last_checkpoint_at: float | None = None  # its newest committed checkpoint
    stopping: bool = False  # a preemption or teardown is under way: its nodes come free soon
    lent_by: tuple[int, ...] = ()
    """Waiting jobs whose reserved nodes it was started on (backfill past a reservation):
    each of them may preempt it once it can start, whatever their priorities."""


def still_lending(
    lent_by: tuple[int, ...], placed_at: float, queued_since: Mapping[int, float]
) -> tuple[int, ...]:
    """The lenders of a job placed at ``placed_at`` on reserved nodes (ADR 0050) that still
    wait for the start they reserved for: queued now (``queued_since``: job -> when it last
    entered the queue), and since before that placement. A lender that started elsewhere
    and was queued again later waits for another start: it no longer lends, and may take
    the nodes back only as any job may."""
    return tuple(j for j in lent_by if queued_since.get(j, placed_at + 1.0) <= placed_at)


@dataclass(frozen=True)
class NodeSlot:
    name: str
    group: str
    free: bool  # idle, undrained, not a spare, a compute node, holding no job
    allocation: int | None = None  # external schedulers: the job whose allocation it is in


@dataclass(frozen=True)
class Snapshot:
    now: float
    queue: tuple[QueuedJob, ...]  # oldest first
    running: tuple[RunningJob, ...]
    nodes: tuple[NodeSlot, ...]  # in the spec's order
    usage: Mapping[str, float] = field(default_factory=dict)
    """Team -> node-seconds used, decayed to ``now`` (see :mod:`trainpod.scheduler.usage`)."""

    def free(self) -> list[NodeSlot]:
        return [n for n in self.nodes if n.free]


@dataclass(frozen=True)
class Place:
    job_id: int
    nodes: tuple[str, ...]
    restart_reason: str = ""
    lent_by: tuple[int, ...] = ()  # the waiting jobs whose reserved nodes it borrows


@dataclass(frozen=True)
class Hold:
    job_id: int
    reason: str  # why it waits, in words its owner can act on
    position: int | None = None  # 1-based place in scheduling order among all queued jobs
    estimated_start: float | None = None  # epoch seconds, where one can be computed


@dataclass(frozen=True)
class Preempt:
    job_id: int
    reason: str
    grace_s: float  # how long its ranks have (to checkpoint) before they are killed


SchedulerDecision = Place | Hold | Preempt


class Scheduler(ABC):
    @abstractmethod
    def plan(self, snapshot: Snapshot) -> list[SchedulerDecision]:
        """What to do now. Pure: the same snapshot gives the same decisions."""

    def wake_at(self, snapshot: Snapshot) -> float | None:
        """When ``plan`` must run again even if nothing changes (None: only on change)."""
        return None
