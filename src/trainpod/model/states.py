"""States of nodes, jobs, attempts and ranks, and the transitions allowed between them.

The tables here are the single source of truth: the controller calls :func:`check` before
every state change, so an illegal transition is a bug that fails loudly, never a silent
corruption of the store.
"""

from __future__ import annotations

import enum
from typing import TypeVar


class _State(str, enum.Enum):
    """A state that prints as its value (``f"{JobState.RUNNING}"`` is ``running``), as the
    API and CLI show it; ``enum.StrEnum`` once Python 3.10 is not supported."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class NodeState(_State):
    PROVISIONING = "provisioning"  # known from the spec, agent not heard from yet
    SETTING_UP = "setting_up"  # agent up, lifecycle scripts running
    IDLE = "idle"
    ALLOCATED = "allocated"
    SUSPECT = "suspect"  # heartbeat missed; may come back
    QUARANTINED = "quarantined"
    REPAIRING = "repairing"
    RETIRED = "retired"
    FAILED = "failed"  # lifecycle script failed or timed out
    STOPPED = "stopped"  # agent shut down on purpose (cluster stop)


class JobState(_State):
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    STOPPING = "stopping"  # cancel or failure teardown in progress
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"  # stopped for another job, queued again; resumes when placed

    @property
    def ended(self) -> bool:
        return self in _JOB_ENDED


class AttemptState(_State):
    LAUNCHING = "launching"  # orders sent, not every rank seen running yet
    RUNNING = "running"
    STOPPING = "stopping"  # teardown ordered; waiting for every rank to end
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self in (AttemptState.SUCCEEDED, AttemptState.FAILED, AttemptState.CANCELLED)


class RankState(_State):
    PENDING = "pending"
    RUNNING = "running"
    EXITED = "exited"  # exit code or signal known
    LOST = "lost"  # its node or agent went away; fate unknown

    @property
    def ended(self) -> bool:
        return self in (RankState.EXITED, RankState.LOST)


_JOB_ENDED = {JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED}

N = NodeState
# A restarted agent reports its lifecycle afresh (running, then ok or failed) whatever state
# its node is in, and a node keeps its job until the job's attempt has ended: so setting_up
# and failed are reachable from idle and allocated, and allocated from them.
NODE_TRANSITIONS: dict[NodeState, set[NodeState]] = {
    N.PROVISIONING: {N.SETTING_UP, N.IDLE, N.FAILED, N.SUSPECT, N.STOPPED},
    N.SETTING_UP: {N.IDLE, N.ALLOCATED, N.FAILED, N.SUSPECT, N.STOPPED, N.QUARANTINED},
    N.IDLE: {N.ALLOCATED, N.SUSPECT, N.QUARANTINED, N.STOPPED, N.SETTING_UP, N.FAILED},
    N.ALLOCATED: {N.IDLE, N.SUSPECT, N.QUARANTINED, N.STOPPED, N.SETTING_UP, N.FAILED},
    N.SUSPECT: {N.IDLE, N.ALLOCATED, N.QUARANTINED, N.SETTING_UP, N.FAILED, N.STOPPED},
    N.QUARANTINED: {N.REPAIRING, N.RETIRED, N.IDLE},
    N.REPAIRING: {N.IDLE, N.RETIRED, N.QUARANTINED, N.SETTING_UP},
    N.RETIRED: {N.REPAIRING},  # only an operator's resume
    N.FAILED: {N.SETTING_UP, N.IDLE, N.ALLOCATED, N.STOPPED, N.SUSPECT, N.QUARANTINED, N.REPAIRING},
    N.STOPPED: {N.SETTING_UP, N.IDLE, N.ALLOCATED, N.FAILED, N.SUSPECT},
}

J = JobState
JOB_TRANSITIONS: dict[JobState, set[JobState]] = {
    J.QUEUED: {J.STARTING, J.CANCELLED, J.FAILED},
    J.STARTING: {J.RUNNING, J.STOPPING, J.FAILED, J.COMPLETED, J.CANCELLED, J.RECOVERING},
    J.RUNNING: {J.STOPPING, J.COMPLETED, J.FAILED, J.RECOVERING},
    J.RECOVERING: {J.STARTING, J.STOPPING, J.FAILED, J.CANCELLED, J.QUEUED, J.PREEMPTED},
    J.STOPPING: {J.FAILED, J.CANCELLED, J.COMPLETED, J.RECOVERING, J.PREEMPTED},
    # Back in the queue after a preemption (the planner takes it like a queued job).
    J.PREEMPTED: {J.STARTING, J.QUEUED, J.CANCELLED, J.FAILED},
    J.COMPLETED: set(),
    J.FAILED: set(),
    J.CANCELLED: set(),
}

A = AttemptState
ATTEMPT_TRANSITIONS: dict[AttemptState, set[AttemptState]] = {
    A.LAUNCHING: {A.RUNNING, A.STOPPING, A.SUCCEEDED, A.FAILED, A.CANCELLED},
    A.RUNNING: {A.STOPPING, A.SUCCEEDED, A.FAILED},
    A.STOPPING: {A.FAILED, A.CANCELLED, A.SUCCEEDED},
    A.SUCCEEDED: set(),
    A.FAILED: set(),
    A.CANCELLED: set(),
}


_S = TypeVar("_S", NodeState, JobState, AttemptState)


class IllegalTransition(RuntimeError):
    """A state change that the tables above do not allow: a controller bug."""


def check(kind: str, table: dict[_S, set[_S]], old: _S, new: _S) -> None:
    """Raise :class:`IllegalTransition` unless ``old -> new`` is allowed (or a no-op)."""
    if old != new and new not in table[old]:
        raise IllegalTransition(f"{kind}: {old.value} -> {new.value} is not allowed")
