"""First-in-first-out gang placement: a pure function over a snapshot.

Jobs are considered in submission order. A job that does not fit holds back every later
job that could use any of its partition's nodes (no backfill), so a large job is never
starved by a stream of small ones. Hot spares are never handed out here: they are kept
for recovery.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QueuedJob:
    id: int
    nodes: int
    groups: frozenset[str]  # the groups of its partition


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
    available = list(free)
    blocked: set[str] = set()
    out: list[Placement] = []
    for job in queue:
        if job.groups & blocked:
            blocked |= job.groups
            continue
        fits = [n for n in available if n.group in job.groups]
        if len(fits) < job.nodes:
            blocked |= job.groups
            continue
        chosen = fits[: job.nodes]
        taken = {n.name for n in chosen}
        available = [n for n in available if n.name not in taken]
        out.append(Placement(job.id, tuple(n.name for n in chosen)))
    return out
