"""The cluster spec's sharing rules as the scheduler reads them, and each job as it sees it.

:func:`sharing_policy` turns the controller config (teams, quotas, fair share, the
preemption grace and minimum run time) into the pure
:class:`~trainpod.scheduler.policy.SharingPolicy`; :class:`Shapes` remembers, per job, what
the scheduler needs of its spec (size, partition, team, priority class, time limit), parsed
once per job rather than once per pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainpod.controller.config import ControllerConfig
from trainpod.controller.transitions import Transitions
from trainpod.scheduler.policy import SharingPolicy, TeamPolicy
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
            )
            self._by_job[job.id] = shape
        return shape

    def keep_only(self, job_ids: set[int]) -> None:
        for gone in set(self._by_job) - job_ids:
            del self._by_job[gone]
