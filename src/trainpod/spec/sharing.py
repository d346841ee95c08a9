"""A cluster shared by teams: priority classes, teams with quotas, users and their roles.

All optional: a spec without them is a single-tenant cluster (one admin token, every job
the same priority, no quotas). With them::

    priority_classes:
      - {name: high, value: 1000, preemptible: false}
      - {name: normal, value: 100, default: true}
      - {name: low, value: 10}
    teams:
      - name: vision
        quota: {gpu: 2}              # partition -> nodes, or {gpu: {devices: 16}}
        weight: 1                    # fair-share weight
        lend: true                   # others may borrow its idle quota
        borrow: true                 # it may borrow others' idle quota ...
        borrow_limit: 2              # ... up to this many nodes beyond its own (none: all)
        default_priority_class: normal
    users:
      - {name: alice, team: vision}                 # role: user
      - {name: root, role: admin}
      - {name: bob, team: vision, account: bob}     # ranks run as POSIX account bob
    fair_share:
      half_life_s: 604800            # usage decays by half in a week (Slurm's default)

Validated against the rest of the spec by :func:`sharing_problems` (partitions and teams
that exist, one default class, device quotas that convert to whole nodes).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

if TYPE_CHECKING:
    from trainpod.spec.cluster import ClusterSpec, SpecProblem

UserRole = Literal["user", "admin"]

_CLASS = re.compile(r"^[a-z][a-z0-9-]{0,29}$")
_USER = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")  # a portable POSIX user name


def _matches(pattern: re.Pattern[str], what: str, rule: str) -> AfterValidator:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{value!r} is not a valid {what} name; use {rule}")
        return value

    return AfterValidator(check)


_NAME_RULE = "1-30 lowercase letters, digits and dashes, starting with a letter"
ClassName = Annotated[StrictStr, _matches(_CLASS, "priority class", _NAME_RULE)]
TeamName = Annotated[StrictStr, _matches(_CLASS, "team", _NAME_RULE)]
UserName = Annotated[
    StrictStr,
    _matches(
        _USER,
        "user",
        "1-32 characters: lowercase letters, digits, `_`, `.` and `-`, "
        "starting with a letter or `_` (a POSIX user name)",
    ),
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class PriorityClassSpec(_Model):
    """A named priority, as Kueue's WorkloadPriorityClass or a Slurm QOS."""

    name: ClassName
    """Unique class name: lowercase letters, digits and dashes."""
    value: StrictInt = Field(ge=0, le=1_000_000)
    """Higher runs first, and may preempt lower classes' preemptible jobs."""
    preemptible: StrictBool = True
    """Whether jobs of this class may be preempted by higher classes or a reclaiming team."""
    default: StrictBool = False
    """The class of jobs that name none (and whose team sets no default)."""


class QuotaAmount(_Model):
    """A team's share of a partition, in whole nodes or in devices (converted to nodes)."""

    nodes: StrictInt | None = Field(default=None, ge=0)
    """Whole nodes."""
    devices: StrictInt | None = Field(default=None, ge=0)
    """Devices (GPUs): a multiple of the partition's devices per node."""

    @model_validator(mode="after")
    def _exactly_one(self) -> QuotaAmount:
        if (self.nodes is None) == (self.devices is None):
            raise ValueError("give exactly one of `nodes` or `devices` (e.g. {nodes: 2})")
        return self


class TeamSpec(_Model):
    """A team: its quota per partition, its fair-share weight, and what it lends or borrows."""

    name: TeamName
    """Unique team name: lowercase letters, digits and dashes."""
    quota: dict[StrictStr, QuotaAmount] = Field(default_factory=dict)
    """Partition -> nodes the team may use at once (or ``{devices: N}``); absent: none of
    its own (it runs only on borrowed capacity, if it may borrow)."""
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    """Fair-share weight: its standing is its decayed usage relative to this."""
    lend: StrictBool = True
    """Other teams may borrow the part of its quota it does not use (and give it back)."""
    borrow: StrictBool = True
    """It may run beyond its quota on capacity that lending teams do not use."""
    borrow_limit: StrictInt | None = Field(default=None, ge=0)
    """Nodes it may borrow beyond its quota, per partition; none: no limit."""
    default_priority_class: StrictStr | None = None
    """The class of its jobs that name none; none: the cluster's default class."""

    @field_validator("quota", mode="before")
    @classmethod
    def _nodes_shorthand(cls, value: object) -> object:
        """``{gpu: 2}`` is ``{gpu: {nodes: 2}}``."""
        if isinstance(value, dict):
            return {
                k: {"nodes": v} if isinstance(v, int) and not isinstance(v, bool) else v
                for k, v in value.items()
            }
        return value


class UserSpec(_Model):
    """A person who submits work: the team they submit as and what they may do."""

    name: UserName
    """The name the user's token acts as (a POSIX user name)."""
    team: StrictStr | None = None
    """Required once the spec declares teams (admins may have none)."""
    role: UserRole = "user"
    """``user``: acts on their own jobs; ``admin``: on anyone's, and on nodes and users."""
    account: UserName | None = None
    """The POSIX account their ranks, allocations and shells run as where the agent runs as
    root (created by the lifecycle scripts, as on HyperPod); none: the agent's own."""


class FairShareSpec(_Model):
    half_life_s: float = Field(default=7 * 86400.0, gt=0, allow_inf_nan=False)
    """Usage counts half after this long (Slurm's PriorityDecayHalfLife; default 7 days)."""


def quota_nodes(spec: ClusterSpec, team: TeamSpec) -> dict[str, int]:
    """The team's quota per partition in whole nodes (devices divided by the partition's
    devices per node; :func:`sharing_problems` made sure that divides)."""
    out: dict[str, int] = {}
    for part, amount in team.quota.items():
        if amount.nodes is not None:
            out[part] = amount.nodes
        else:
            per_node = _devices_per_node(spec, part)
            out[part] = (amount.devices or 0) // (per_node or 1)
    return out


def _devices_per_node(spec: ClusterSpec, partition: str) -> int | None:
    """The devices per node of the partition's job nodes, if all agree."""
    groups = spec.groups_by_name()
    parts = {p.name: p for p in spec.effective_partitions()}
    members = [groups[g] for g in parts[partition].groups if g in groups and not groups[g].spare]
    counts = {g.devices_per_node for g in members}
    return counts.pop() if len(counts) == 1 else None


def sharing_problems(spec: ClusterSpec) -> list[SpecProblem]:
    """What is wrong with the spec's classes, teams and users, against the rest of it."""
    from trainpod.spec.cluster import SpecProblem

    problems: list[SpecProblem] = []

    def dupes(kind: str, names: list[str]) -> None:
        seen: set[str] = set()
        for i, name in enumerate(names):
            if name in seen:
                fix = f"give each of {kind} a unique name"
                problems.append(SpecProblem((kind, i, "name"), "duplicate name", name, fix))
            seen.add(name)

    classes = [c.name for c in spec.priority_classes]
    dupes("priority_classes", classes)
    defaults = [i for i, c in enumerate(spec.priority_classes) if c.default]
    for i in defaults[1:]:
        reason = f"priority_classes[{defaults[0]}] is already the default"
        fix = "mark at most one priority class `default: true`"
        problems.append(SpecProblem(("priority_classes", i, "default"), reason, True, fix))
    dupes("teams", [t.name for t in spec.teams])
    dupes("users", [u.name for u in spec.users])
    partitions = {p.name for p in spec.effective_partitions()}
    for i, team in enumerate(spec.teams):
        for part, amount in team.quota.items():
            loc = ("teams", i, "quota", part)
            if part not in partitions:
                fix = f"use one of the partitions: {', '.join(sorted(partitions))}"
                problems.append(SpecProblem(loc, "no such partition", part, fix))
                continue
            if amount.devices is not None:
                per_node = _devices_per_node(spec, part)
                if per_node is None:
                    reason = "its nodes do not all have the same number of devices"
                    fix = "give this quota in nodes ({nodes: N})"
                    problems.append(SpecProblem(loc, reason, amount.devices, fix))
                elif per_node == 0 or amount.devices % per_node:
                    reason = f"not a whole number of nodes ({per_node} devices per node)"
                    fix = f"use a multiple of {per_node}, or give it in nodes"
                    problems.append(SpecProblem(loc, reason, amount.devices, fix))
        cls = team.default_priority_class
        if cls is not None and cls not in classes:
            fix = f"use one of priority_classes: {', '.join(classes) or '(none declared)'}"
            at = ("teams", i, "default_priority_class")
            problems.append(SpecProblem(at, "no such priority class", cls, fix))
    teams = {t.name for t in spec.teams}
    for i, user in enumerate(spec.users):
        if user.team is not None and user.team not in teams:
            fix = f"use one of the teams: {', '.join(sorted(teams)) or '(none declared)'}"
            problems.append(SpecProblem(("users", i, "team"), "no such team", user.team, fix))
        elif user.team is None and teams and user.role != "admin":
            fix = "give the user a `team:` (only admins may have none)"
            problems.append(SpecProblem(("users", i, "team"), "missing team", None, fix))
    return problems
