"""The recovery ladder: a pure function from (job, fault, cluster snapshot) to a decision.

| fault            | decision                                                               |
|------------------|------------------------------------------------------------------------|
| crash            | restart on the same nodes; the same failure twice in a row = user error |
| hang             | restart on the same nodes (faulty ones were quarantined by their checks) |
| gpu_fault, lost  | replace the bad nodes (spares first), restart; none free: wait, or      |
|  node, straggler | shrink to ``min_nodes`` when the job allows it                          |
| any, no resume   | fail with the reason (the job did not ask for --auto-resume)           |

Crash and hang restarts count against ``max_restarts``; node faults do not, since they are
not the job's doing, but they are capped at ``NODE_FAULT_RESTART_CAP``. The controller
executes the decision; nothing here touches a store.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from signal import SIGABRT, SIGBUS, SIGFPE, SIGILL, SIGSEGV

# Node faults are not the job's doing, so they do not use up max_restarts; but a job that
# keeps taking nodes down (a kernel that triggers XIDs) must not cycle through the cluster.
NODE_FAULT_RESTART_CAP = 10


class FaultKind(str, enum.Enum):
    CRASH = "crash"
    HANG = "hang"
    GPU_FAULT = "gpu_fault"
    NODE_FAULT = "node_fault"  # disk full, memory, another failed health check
    NODE_LOST = "node_lost"
    STRAGGLER = "straggler"
    QUARANTINED = "quarantined"  # an operator took a node away

    @property
    def node_fault(self) -> bool:
        return self in _NODE_FAULTS


_NODE_FAULTS = {
    FaultKind.GPU_FAULT,
    FaultKind.NODE_FAULT,
    FaultKind.NODE_LOST,
    FaultKind.STRAGGLER,
    FaultKind.QUARANTINED,
}


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    reason: str
    nodes: tuple[str, ...] = ()  # the nodes at fault (node faults) or where it showed (crash)
    signature: str = ""  # what identifies "the same failure" (crash: exit code + last line)


@dataclass(frozen=True)
class JobView:
    id: int
    auto_resume: bool
    max_restarts: int
    restarts_used: int  # restarts so far that count against max_restarts
    nodes: int
    min_nodes: int | None
    groups: frozenset[str]
    attempt_nodes: tuple[str, ...]  # the nodes of the attempt that just failed
    previous: Fault | None = None  # the fault that ended the attempt before this one
    node_restarts_used: int = 0  # restarts after node faults (capped separately)


@dataclass(frozen=True)
class NodeView:
    name: str
    group: str
    spare: bool
    healthy: bool  # not quarantined, suspect, failed, repairing or retired
    free: bool  # idle and not drained


@dataclass(frozen=True)
class Restart:
    nodes: tuple[str, ...]
    replaced: dict[str, str] = field(default_factory=dict)  # bad node -> its replacement
    counts: bool = True  # counts against max_restarts
    reason: str = ""
    shrunk: bool = False


@dataclass(frozen=True)
class Wait:
    reason: str
    keep: tuple[str, ...]  # healthy nodes the job holds on to while it waits


@dataclass(frozen=True)
class Fail:
    reason: str


Decision = Restart | Wait | Fail


def decide(job: JobView, fault: Fault, nodes: Sequence[NodeView]) -> Decision:
    """The next step for a job whose attempt failed with ``fault``."""
    if not job.auto_resume:
        return Fail(f"{fault.reason} (submit with --auto-resume to recover automatically)")
    counts = not fault.kind.node_fault
    if not counts and job.node_restarts_used >= NODE_FAULT_RESTART_CAP:
        return Fail(
            f"{fault.reason}; gave up after {job.node_restarts_used} restarts for node faults "
            "in a row of attempts: the job itself may be breaking its nodes"
        )
    if counts and job.restarts_used >= job.max_restarts:
        return Fail(f"{fault.reason}; gave up after {job.restarts_used} restarts (max_restarts)")
    if (
        fault.kind is FaultKind.CRASH
        and job.previous is not None
        and job.previous.kind is FaultKind.CRASH
        and fault.signature
        and fault.signature == job.previous.signature
    ):
        return Fail(
            f"user error: the same failure twice on healthy nodes, not retrying: {fault.reason}"
        )
    by_name = {n.name: n for n in nodes}

    def is_bad(name: str) -> bool:
        view = by_name.get(name)
        if view is None or not view.healthy:
            return True
        # A node at fault stays bad until it is back in the pool (repaired and free): a job
        # waiting for a replacement may then take its own node back.
        return fault.kind.node_fault and name in fault.nodes and not view.free

    bad = [n for n in job.attempt_nodes if is_bad(n)]
    if not bad:
        return Restart(job.attempt_nodes, counts=counts, reason=f"restart after {fault.kind.value}")
    keep = tuple(n for n in job.attempt_nodes if n not in bad)
    pool = [
        n
        for n in nodes
        if n.free and n.healthy and n.group in job.groups and n.name not in job.attempt_nodes
    ]
    pool.sort(key=lambda n: (not n.spare, n.name))  # hot spares first
    if len(pool) >= len(bad):
        replaced = dict(zip(bad, (n.name for n in pool), strict=False))
        new = tuple(replaced.get(n, n) for n in job.attempt_nodes)
        swaps = ", ".join(f"{b} -> {r}" for b, r in replaced.items())
        return Restart(new, replaced, counts, f"replaced {swaps} after {fault.kind.value}")
    if job.min_nodes is not None and len(keep) + len(pool) >= job.min_nodes:
        extra = tuple(n.name for n in pool)
        new = keep + extra
        return Restart(
            new,
            dict(zip(bad, extra, strict=False)),
            counts,
            f"continuing on {len(new)} of {job.nodes} nodes (min_nodes {job.min_nodes}) "
            f"after {fault.kind.value}",
            shrunk=True,
        )
    return Wait(
        f"waiting for a healthy node to replace {', '.join(bad)} ({fault.kind.value})", keep
    )


def crash_signature(exit_code: int | None, signal: int | None, log_tail: str) -> str:
    """Two crashes are 'the same' when they end the same way.

    A rank whose log ends in a Python traceback raised: its signature is the exception that
    ended it (``raised RuntimeError: bad batch``), whether the process then exited with 1 or
    aborted itself in its teardown. Without ``destroy_process_group`` a Gloo or NCCL script
    that raises may die of SIGABRT while the interpreter finalizes, after printing its
    traceback (pytorch/pytorch#179291), and one of two identical failures must not look
    different for it. Otherwise: the exit code and the last log line.

    "" (never the same as anything) when the rank said nothing or was killed by a signal from
    outside: two SIGKILLs in a row (an operator, an OOM killer, chaos) are not evidence of a
    bug. A signal the process raises itself (SIGABRT, SIGSEGV, ...) counts only after a
    traceback: alone it may be the hardware's doing."""
    lines = [_RANK_PREFIX.sub("", line, count=1).rstrip() for line in log_tail.splitlines()]
    raised = _raised(lines)
    if raised is not None and (signal is None or signal in _SELF_INFLICTED):
        return f"raised {raised}"
    said = [line.strip() for line in lines if line.strip()]
    if signal is not None or not said:
        return ""
    return f"code={exit_code} signal={signal} last={said[-1]}"


TEARDOWN_TERMINATE = "terminate called without an active exception"
"""libstdc++'s last words when a joinable ``std::thread`` is destroyed: Gloo's worker threads
met by the interpreter's finalization (pytorch/pytorch#179291)."""


def teardown_abort(signal: int | None, log_tail: str) -> bool:
    """A rank that aborted in its interpreter's teardown, not in its work: SIGABRT, its log's
    last line libstdc++'s :data:`TEARDOWN_TERMINATE`, and no Python traceback before it (one
    that raised is a failure, whatever ends it). Whether that was after a finished run only
    its peers can tell: :func:`trainpod.controller.judge.judge` asks them."""
    if signal != SIGABRT:
        return False
    lines = [_RANK_PREFIX.sub("", line, count=1).strip() for line in log_tail.splitlines()]
    said = [line for line in lines if line]
    return bool(said) and said[-1] == TEARDOWN_TERMINATE and _raised(lines) is None


def _raised(lines: Sequence[str]) -> str | None:
    """The exception line of the last Python traceback in ``lines`` (its first unindented
    line after the header), or None when there is none or the tail cut it off."""
    header = None
    for i, line in enumerate(lines):
        if line.strip() == "Traceback (most recent call last):":
            header = i
    if header is None:
        return None
    for line in lines[header + 1 :]:
        if line and not line[0].isspace():
            return line.strip()
    return None


# Signals a process sends itself (abort(), a bad access, a bad instruction): what a crashing
# interpreter or library dies of, not an operator, an OOM killer or a scheduler.
_SELF_INFLICTED = frozenset({SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL})

# torch prefixes every line of a rank's traceback with "[rank3]: " once a process group
# exists (its excepthook); which rank reports first must not make two identical failures
# look different. Only the prefix goes: a traceback's indentation tells frames from its end.
_RANK_PREFIX = re.compile(r"^\s*\[rank\d+\]: ?")
