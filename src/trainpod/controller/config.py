"""What the controller needs to know about its cluster, decoupled from the YAML spec."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainpod.scheduler.policy import DEFAULT_MIN_RUN_S
from trainpod.spec.carbon import Intensity, world_average
from trainpod.spec.sharing import PriorityClassSpec, TeamSpec, UserSpec


@dataclass(frozen=True)
class NodeDecl:
    """A node the cluster is made of, as the spec declares it."""

    name: str
    group: str
    role: str
    spare: bool
    devices: int


@dataclass(frozen=True)
class PreemptionConfig:
    """The notice a preempted job's ranks get (``preemption:`` in the spec)."""

    signal: str = "SIGUSR1"  # a validated name: the agent sends it to every rank's group
    grace_s: float = 30.0  # notice -> teardown (SIGTERM, then SIGKILL after teardown_grace_s)
    min_run_s: float = DEFAULT_MIN_RUN_S  # a job younger than this is not a victim
    lend_reserved: bool = True  # backfill past a reservation, preemptible (ADR 0050)


@dataclass(frozen=True)
class ControllerConfig:
    cluster: str
    backend: str
    nodes: list[NodeDecl]
    partitions: dict[str, list[str]]  # partition -> group names
    default_partition: str
    jobs_dir: Path  # per-rank logs live under jobs_dir/<job>/attempt-<n>/
    shared_dir: Path
    scratch_root: Path
    checkpoint_uri: str
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    teardown_grace_s: float = 5.0
    max_restarts: int = 3
    hang_timeout_s: float = 120.0
    exit_wait_s: float = 60.0
    straggler_factor: float = 1.5
    straggler_checks: int = 5
    auto_repair: bool = True
    retire_after: int = 3
    deep_check_timeout_s: float = 180.0
    in_process_deadline_s: float = 60.0  # a replaced rank must run again within (ADR 0026)
    event_retention_days: float = 30.0  # older events go, except those of live jobs
    preemption: PreemptionConfig = PreemptionConfig()
    extra: dict[str, str] = field(default_factory=dict)
    priority_classes: tuple[PriorityClassSpec, ...] = ()
    teams: tuple[TeamSpec, ...] = ()
    team_quotas: dict[str, dict[str, int]] = field(default_factory=dict)
    """team -> partition -> nodes (device quotas converted)."""
    users: tuple[UserSpec, ...] = ()
    fair_share_half_life_s: float = 7 * 86400.0
    operator: str = "admin"
    """The name the cluster's admin token acts as (the cluster's creator)."""
    carbon: Intensity = field(default_factory=world_average)
    """The grid's carbon intensity (the spec's ``carbon:``; default: the world average)."""
    view_cache_bytes: int = 64 << 20
    """What each of the views' caches may hold (the spec's ``controller.view_cache_mib``)."""

    def priority_class(self, name: str) -> PriorityClassSpec | None:
        return next((c for c in self.priority_classes if c.name == name), None)

    def default_priority_class(self, team: str | None) -> str | None:
        """The class of a job that names none: its team's default, else the cluster's."""
        t = next((t for t in self.teams if t.name == team), None)
        if t is not None and t.default_priority_class:
            return t.default_priority_class
        return next((c.name for c in self.priority_classes if c.default), None)

    def checkpoint_for(self, job_id: int) -> tuple[str, str | None]:
        """The job's checkpoint URI and, when it is a local path, that path."""
        uri = f"{self.checkpoint_uri.rstrip('/')}/job-{job_id}"
        if uri.startswith("file://"):
            return uri, uri[len("file://") :]
        return uri, None
