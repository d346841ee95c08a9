"""The cluster spec's sharing rules as the scheduler reads them, and each job as it sees it.

:func:`sharing_policy` turns the controller config (teams, quotas, fair share, the
preemption grace and minimum run time) into the pure
:class:`~trainpod.scheduler.policy.SharingPolicy`; :class:`Shapes` remembers, per job, what
the scheduler needs of its spec (size, partition, team, priority class, time limit), parsed
once per job rather than once per pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainpod.controller.config import ControllerConfig
from trainpod.controller.transitions import Transitions
from trainpod.scheduler.policy import SharingPolicy, TeamPolicy
from trainpod.scheduler.usage import UsageInterval, decayed_usage
from trainpod.store.repo import Store
from trainpod.store.rows import JobRow


def sharing_policy(cfg: ControllerConfig) -> SharingPolicy:
    teams = tuple(
        TeamPolicy(
            name=t.name,
            quota=cfg.team_quotas.get(t.name, {}),
            weight=t.weight,
            lend=t.lend,
            borrow=t.borrow,
            borrow_limit=t.borrow_limit,
        )
        for t in cfg.teams
    )
    return SharingPolicy(
        teams=teams,
        half_life_s=cfg.fair_share_half_life_s,
        min_run_s=cfg.preemption.min_run_s,
        grace_s=cfg.preemption.grace_s,
        lend_reserved=cfg.preemption.lend_reserved,
    )


@dataclass(frozen=True)
class Shape:
    nodes: int
    groups: frozenset[str]
    partition: str
    team: str
    user: str
    priority: int
    priority_class: str
    preemptible: bool
    time_limit_s: float | None
    interactive: bool = False


@dataclass
class Shapes:
    cfg: ControllerConfig
    tx: Transitions
    _by_job: dict[int, Shape] = field(default_factory=dict)

    def of(self, job: JobRow) -> Shape:
        shape = self._by_job.get(job.id)
        if shape is None:
            spec = self.tx.spec(job)
            part = spec.partition or self.cfg.default_partition
            cls = self.cfg.priority_class(spec.priority_class or "")
            shape = Shape(
                nodes=spec.nodes,
                groups=frozenset(self.cfg.partitions.get(part, [])),
                partition=part,
                team=spec.team,
                user=spec.user,
                priority=cls.value if cls is not None else 0,
                priority_class=cls.name if cls is not None else "",
                preemptible=cls.preemptible if cls is not None else True,
                time_limit_s=spec.time_limit_s(),
                interactive=spec.interactive,
            )
            self._by_job[job.id] = shape
        return shape

    def keep_only(self, job_ids: set[int]) -> None:
        for gone in set(self._by_job) - job_ids:
            del self._by_job[gone]


@dataclass
class UsageBook:
    """Teams' decayed usage for every pass, without re-reading every attempt ever run.

    Ended attempts are folded once into a per-team sum kept at a reference time (a sum of
    decayed terms decays as a whole: ``U(t) = U(t0) * 2^-((t - t0) / half_life)``); each
    pass reads only the attempts still running or ended since the previous read."""

    store: Store
    half_life_s: float
    _ended: dict[str, float] = field(default_factory=dict)
    _at: float | None = None  # the reference time of _ended
    _folded: dict[int, float] = field(default_factory=dict)  # ended attempts in _ended: end
    _read_at: float | None = None

    def usage(self, now: float) -> dict[str, float]:
        since = now - 20 * self.half_life_s if self._read_at is None else self._read_at - 60
        self._read_at = now
        rows = self.store.usage_since(since)
        if self._at is not None:
            factor = math.exp(-math.log(2) * (now - self._at) / self.half_life_s)
            self._ended = {t: u * factor for t, u in self._ended.items()}
        self._at = now
        live: list[UsageInterval] = []
        for attempt, team, nodes, start, end in rows:
            if end is None:
                live.append(UsageInterval(team, nodes, start, None))
            elif attempt not in self._folded and end <= now:
                self._folded[attempt] = end
                one = UsageInterval(team, nodes, start, end)
                done = decayed_usage([one], now, self.half_life_s).get(team, 0.0)
                self._ended[team] = self._ended.get(team, 0.0) + done
        # What ended before this read's window is never read again: forget it.
        self._folded = {a: e for a, e in self._folded.items() if e >= since}
        out = dict(self._ended)
        for team, value in decayed_usage(live, now, self.half_life_s).items():
            out[team] = out.get(team, 0.0) + value
        return out
