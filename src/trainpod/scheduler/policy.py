"""How a shared cluster is shared: priority classes, teams' quotas and the sharing knobs.

Pure data, checked when built: a bad value raises :class:`ValueError` naming the field and
how to fix it. The cluster spec builds these; :class:`~trainpod.scheduler.shared.SharedScheduler`
reads them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

DEFAULT_MIN_RUN_S = 120.0
"""Seconds a job runs before it may be chosen as a preemption victim, unless the spec says
otherwise (``preemption.min_run_s``; Slurm's ``PreemptExemptTime``). Slurm's default is 0,
which lets a job be preempted the moment it starts: it loses its whole start-up
(rendezvous, loading, warm-up) and has no checkpoint to resume from, and a stream of
higher-priority arrivals makes it thrash. Two minutes covers a start and a first checkpoint
at the intervals trainpod's jobs use, and bounds what it costs a preemptor: it waits at most
this long, and only when every victim that would free its nodes started that recently (the
scheduler then holds it with a wake-up for when the youngest victim's minimum run ends).
See docs/decisions/0017-isolation-and-secrets.md."""


@dataclass(frozen=True)
class PriorityClass:
    """A named priority: higher ``value`` runs first and may preempt ``preemptible`` work."""

    name: str
    value: int
    preemptible: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a priority class needs a name")


@dataclass(frozen=True)
class TeamPolicy:
    """One team's share: ``quota`` maps a partition to the nodes the team may hold there at
    once; ``weight`` is its fair-share weight; it may ``lend`` its idle quota and ``borrow``
    others' (at most ``borrow_limit`` nodes beyond its quota per partition; None: no limit)."""

    name: str
    quota: Mapping[str, int] = field(default_factory=dict)
    weight: float = 1.0
    lend: bool = True
    borrow: bool = True
    borrow_limit: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a team needs a name")
        for part, nodes in self.quota.items():
            if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 0:
                raise ValueError(
                    f"team {self.name}: quota for partition {part!r} is {nodes!r};"
                    " give a whole number of nodes, 0 or more"
                )
        object.__setattr__(self, "quota", MappingProxyType(dict(self.quota)))
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(
                f"team {self.name}: fair-share weight is {self.weight!r}; give a number above 0"
            )
        if self.borrow_limit is not None and self.borrow_limit < 0:
            raise ValueError(
                f"team {self.name}: borrow_limit is {self.borrow_limit}; give 0 or more nodes,"
                " or leave it unset for no limit"
            )

    def quota_in(self, partition: str) -> int:
        return self.quota.get(partition, 0)


@dataclass(frozen=True)
class SharingPolicy:
    """The cluster's sharing rules. No teams: no quotas (priority, fair share by the teams
    seen and backfill still apply)."""

    teams: tuple[TeamPolicy, ...] = ()
    half_life_s: float = 7 * 86400.0  # usage decay, as Slurm's PriorityDecayHalfLife
    min_run_s: float = DEFAULT_MIN_RUN_S  # a job runs this long before it may be preempted
    grace_s: float = 30.0  # a victim's time to checkpoint before it is killed
    backfill: bool = True
    lend_reserved: bool = True
    """A preemptible job that fits nodes a waiting job has reserved, but whose time limit
    (or none) reaches past that job's expected start, may start on them; the waiting job
    preempts it once it can start (ADR 0050)."""

    def __post_init__(self) -> None:
        names = [t.name for t in self.teams]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"team {dupes[0]} is declared twice; give each team once")
        if not (self.half_life_s > 0):
            raise ValueError(
                f"half_life_s is {self.half_life_s!r}; give a usage half-life above 0 seconds"
            )
        if self.min_run_s < 0:
            raise ValueError(f"min_run_s is {self.min_run_s!r}; give 0 or more seconds")
        if self.grace_s < 0:
            raise ValueError(f"grace_s is {self.grace_s!r}; give 0 or more seconds")

    @property
    def lend_min_s(self) -> float:
        """The least time a job started on lent nodes gets before their owner's expected
        start: its minimum run time, and no less than a victim's grace."""
        return max(self.min_run_s, self.grace_s)

    def team(self, name: str) -> TeamPolicy | None:
        for t in self.teams:
            if t.name == name:
                return t
        return None
