"""The cluster spec: what a trainpod cluster is made of, as strict, frozen pydantic models.

Load a spec with :func:`trainpod.spec.loading.load_cluster_spec`; it turns every problem into
one :class:`~trainpod.errors.SpecError`. Validators here raise :class:`SpecProblems`, which
carries the key path (relative to the model being validated), the reason, the value received
and the fix, so the loader can print ``file: key.path: reason; got value. Fix: ...``.

Relative paths resolve against ``context["base_dir"]`` passed to ``model_validate`` (the spec
file's directory); without it, against the current directory. After validation every path is
absolute, so ``parse(spec.model_dump(mode="json"))`` gives back an equal spec.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from trainpod.spec import carbon
from trainpod.spec.carbon import Intensity, world_average
from trainpod.spec.preemption import PreemptionPolicy
from trainpod.spec.sharing import (
    FairShareSpec,
    PriorityClassSpec,
    TeamSpec,
    UserSpec,
    sharing_problems,
)
from trainpod.spec.tls import ControllerSpec
from trainpod.spec.workerenv import DEFAULT_ENV_ALLOW, EnvAllowEntry

Backend = Literal["local", "slurm"]
Role = Literal["head", "compute"]

MAX_GROUP_COUNT = 64


class _Nothing:
    """Marks a problem that has no single received value worth showing."""

    def __repr__(self) -> str:
        return "<nothing>"


NOTHING: Any = _Nothing()


class SpecProblem(NamedTuple):
    """One thing wrong with a spec, at ``loc`` relative to the model that found it."""

    loc: tuple[str | int, ...]
    reason: str
    got: Any
    fix: str


class SpecProblems(ValueError):
    """Raised by validators; pydantic keeps the instance in the error's ``ctx["error"]``."""

    def __init__(self, problems: list[SpecProblem]) -> None:
        super().__init__("; ".join(f"{p.reason} (fix: {p.fix})" for p in problems))
        self.problems = problems


def _problem(reason: str, got: Any, fix: str, *loc: str | int) -> SpecProblems:
    return SpecProblems([SpecProblem(tuple(loc), reason, got, fix)])


def _name_check(max_len: int, what: str) -> Callable[[str], str]:
    pattern = re.compile(rf"^[a-z][a-z0-9-]{{0,{max_len - 1}}}$")

    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise _problem(
                f"not a valid {what} name",
                value,
                f"use 1-{max_len} characters: lowercase letters, digits and dashes, "
                "starting with a letter",
            )
        return value

    return check


ClusterName = Annotated[StrictStr, AfterValidator(_name_check(40, "cluster"))]
GroupName = Annotated[StrictStr, AfterValidator(_name_check(30, "instance group"))]
PartitionName = Annotated[StrictStr, AfterValidator(_name_check(30, "partition"))]
Seconds = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Amount = Seconds  # a finite number that is not a duration (GiB, a factor, degrees)


def _base_dir(info: ValidationInfo) -> Path:
    context = info.context if isinstance(info.context, dict) else {}
    base = context.get("base_dir")
    return Path(base) if base is not None else Path.cwd()


def _absolute(path: Path, info: ValidationInfo) -> Path:
    # normpath, not resolve(): keep symlinks as written, only drop `.` and `..`.
    return Path(os.path.normpath(_base_dir(info) / path.expanduser()))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class LifecycleScript(_Model):
    """A script run on every node of a group after the node comes up, in list order."""

    script: Path
    """The script; relative paths resolve against the spec file's directory. Absolute after
    loading. It must exist and be a file."""
    timeout_s: Seconds = Field(default=300.0, gt=0)
    """Seconds the script may run before the node's setup counts as failed."""
    args: tuple[StrictStr, ...] = ()
    """Extra command-line arguments passed to the script."""

    @field_validator("script", mode="after")
    @classmethod
    def _script_exists(cls, value: Path, info: ValidationInfo) -> Path:
        resolved = _absolute(value, info)
        if not resolved.is_file():
            reason = "is a directory, not a script" if resolved.is_dir() else "file not found"
            raise _problem(
                reason, str(value), f"create the file or correct the path (resolved to {resolved})"
            )
        return resolved


def _hostlist(value: str) -> str:
    from trainpod.slurm.hostlist import HostlistError, expand

    try:
        if not expand(value):
            raise HostlistError("empty")
    except HostlistError as exc:
        raise _problem(
            f"not a Slurm host list ({exc})", value, "write e.g. node[1-4] or gpu-01,gpu-02"
        ) from None
    return value


class SlurmNodes(_Model):
    """How a group's nodes appear in Slurm (``backend: slurm``)."""

    nodes: Annotated[StrictStr, AfterValidator(_hostlist)]
    """The group's Slurm node names as a host list, e.g. ``node[1-4]``; ``count`` must match."""
    cpus: StrictInt | None = Field(default=None, ge=1)
    """CPUs per node for the rendered ``NodeName`` line (``trainpod slurm render-conf``)."""
    real_memory_mib: StrictInt | None = Field(default=None, ge=1)
    """RealMemory (MiB) for the rendered ``NodeName`` line."""
    features: tuple[StrictStr, ...] = ()
    """Slurm node features for the rendered ``NodeName`` line."""


class SlurmSpec(_Model):
    """Where the Slurm cluster is and what every batch job needs (``backend: slurm``)."""

    conf: Path | None = None
    """slurm.conf to use (exported as ``SLURM_CONF`` to every Slurm command); None: the
    environment's ``SLURM_CONF`` at ``cluster create``, else Slurm's default."""
    sbatch_options: tuple[StrictStr, ...] = ()
    """Extra ``sbatch`` options for every job, verbatim (e.g. ``--account=ml``)."""

    @field_validator("conf", mode="after")
    @classmethod
    def _resolve_conf(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return None if value is None else _absolute(value, info)

    @field_validator("sbatch_options", mode="after")
    @classmethod
    def _options(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for opt in value:
            if re.search(r"[\x00-\x1f\x7f]", opt):
                raise _problem(
                    "holds a control character (a line break would end the #SBATCH line "
                    "and start a shell command in the batch script)",
                    opt,
                    "write the option on one line, e.g. --account=ml",
                )
            if not opt.startswith("--") or opt.split("=")[0] in _MANAGED_SBATCH:
                raise _problem(
                    "not an sbatch option trainpod leaves to you",
                    opt,
                    "give long options like --account=ml; trainpod sets "
                    + ", ".join(sorted(_MANAGED_SBATCH))
                    + " itself",
                )
        return value


_MANAGED_SBATCH = {
    "--job-name",
    "--nodes",
    "--ntasks-per-node",
    "--exclusive",
    "--partition",
    "--no-kill",
    "--requeue",
    "--open-mode",
    "--output",
}


class InstanceGroup(_Model):
    """A set of identical nodes; its nodes are named ``<name>-0`` .. ``<name>-<count-1>``."""

    name: GroupName
    """Unique group name: lowercase letters, digits and dashes, at most 30 characters."""
    role: Role = "compute"
    """``head`` runs the controller (at most one node); ``compute`` nodes run jobs."""
    count: StrictInt = Field(ge=1, le=MAX_GROUP_COUNT)
    """Number of nodes in the group (1-64; a head group must have exactly 1)."""
    devices_per_node: StrictInt = Field(default=1, ge=0)
    """Accelerators (GPUs) per node; 0 for CPU-only nodes such as the head."""
    spare: StrictBool = False
    """True puts the group in the hot-spare pool that replaces failed nodes (compute only)."""
    lifecycle: tuple[LifecycleScript, ...] = ()
    """Scripts run in order on each node after it comes up."""
    slurm: SlurmNodes | None = None
    """With ``backend: slurm``: the group's Slurm nodes (node names, CPUs, memory)."""

    @model_validator(mode="after")
    def _check_role(self) -> InstanceGroup:
        problems: list[SpecProblem] = []
        if self.slurm is not None:
            from trainpod.slurm.hostlist import expand

            n = len(expand(self.slurm.nodes))
            if n != self.count:
                reason = f"count is {self.count} but slurm.nodes names {n} nodes"
                fix = f"set `count: {n}` or correct slurm.nodes"
                problems.append(SpecProblem(("count",), reason, self.count, fix))
        if self.role == "head" and self.count != 1:
            reason, fix = "one head node is supported", "set `count: 1`"
            problems.append(SpecProblem(("count",), reason, self.count, fix))
        if self.role == "head" and self.spare:
            reason, fix = "only compute groups can be spares", "remove `spare: true`"
            problems.append(SpecProblem(("spare",), reason, True, fix + " or set `role: compute`"))
        if problems:
            raise SpecProblems(problems)
        return self


class StorageSpec(_Model):
    """Where the cluster keeps shared files, node-local scratch and durable checkpoints."""

    shared_dir: Path | None = None
    """The shared (parallel) file system every node sees; relative paths resolve against the
    spec file's directory. None: the cluster picks a directory under its state dir."""
    node_scratch_root: Path | None = None
    """Root of the node-local fast scratch (NVMe); each node gets a subdirectory.
    None: the cluster picks one."""
    checkpoint_uri: StrictStr | None = None
    """Durable checkpoint location, ``file:///abs/path`` or ``s3://bucket/prefix``. A bare
    path is accepted and stored as ``file://<absolute path>``. None: under the shared dir."""
    node_scratch_quota_gib: Amount | None = Field(default=None, gt=0)
    """Space each node may use in its scratch dir, in GiB; the disk check faults a node
    past it. None: only the file system's free space counts."""
    min_free_gib: Amount = Field(default=0.5, ge=0)
    """Free space below which the disk check faults a node's scratch or the shared dir."""
    state_db_busy_timeout_s: Seconds = Field(default=10.0, gt=0, le=600)
    """How long a write waits for a lock another process holds on the controller's database
    (a backup, a ``sqlite3`` shell) before the call is refused with 503 (ADR 0034)."""

    @field_validator("shared_dir", "node_scratch_root", mode="after")
    @classmethod
    def _resolve_dir(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return None if value is None else _absolute(value, info)

    @field_validator("checkpoint_uri", mode="after")
    @classmethod
    def _check_uri(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _checkpoint_uri(value, info)


class Partition(_Model):
    """A named set of compute groups that jobs are submitted to."""

    name: PartitionName
    """Unique partition name: lowercase letters, digits and dashes, at most 30 characters."""
    groups: tuple[StrictStr, ...] = Field(min_length=1)
    """Names of the compute groups (spares included) whose nodes belong to this partition."""
    default: StrictBool = False
    """Jobs that name no partition go to the default one; at most one may be marked, and if
    none is, the first partition is the default."""


class HealthPolicy(_Model):
    """How node liveness is judged."""

    heartbeat_interval_s: Seconds = Field(default=1.0, gt=0)
    """Seconds between two heartbeats of a node agent."""
    heartbeat_timeout_s: Seconds = Field(default=10.0, gt=0)
    """Seconds without a heartbeat before a node becomes suspect; above the interval."""
    check_interval_s: Seconds = Field(default=2.0, gt=0)
    """Seconds between two runs of a node's health checks (GPU, disk, memory, clock)."""
    hang_timeout_s: Seconds = Field(default=120.0, gt=0)
    """Seconds without a progress beacon, once a job has sent one, before it is declared
    hung (jobs may override with --hang-timeout-s)."""
    exit_wait_s: Seconds = Field(default=60.0, ge=0)
    """Seconds a rank may stay running with no CPU used after every other rank of its
    attempt exited 0, before it is stopped as stuck in its teardown and the attempt counts
    as a success (Slurm's ``WaitTime``, for idle ranks only); 0 waits forever."""
    straggler_factor: Amount = Field(default=1.5, gt=1)
    """A rank whose step time exceeds this multiple of its peers' median is a straggler."""
    straggler_checks: StrictInt = Field(default=5, ge=1)
    """Consecutive checks (one per heartbeat) a rank must straggle before it is flagged."""
    max_temperature_c: Amount = Field(default=85.0, gt=0)
    """GPU temperature above which the GPU check warns."""

    @model_validator(mode="after")
    def _timeout_above_interval(self) -> HealthPolicy:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise _problem(
                f"must be greater than heartbeat_interval_s ({self.heartbeat_interval_s})",
                self.heartbeat_timeout_s,
                "raise heartbeat_timeout_s (about 10 intervals is typical) "
                "or lower heartbeat_interval_s",
                "heartbeat_timeout_s",
            )
        return self


class RecoveryPolicy(_Model):
    """What the controller does when a job's node fails."""

    teardown_grace_s: Seconds = Field(default=5.0, ge=0)
    """Seconds a job's processes get to exit after SIGTERM before they are killed."""
    max_restarts: StrictInt = Field(default=3, ge=0)
    """Default number of automatic restarts of a job after failures (jobs may override).
    Restarts caused by a node fault (GPU, lost node) do not count: they are not the job's."""
    auto_repair: StrictBool = True
    """Repair quarantined nodes automatically (a fresh instance: clean scratch, lifecycle
    scripts again, then the deep health check) and return them to the pool."""
    retire_after: StrictInt = Field(default=3, ge=1)
    """Failed repairs after which a node is retired for good."""
    deep_check_timeout_s: Seconds = Field(default=180.0, gt=0)
    """Seconds the deep health check (burn-in) of a node may take."""


class CarbonSpec(_Model):
    """The grid's carbon intensity, for CO2e = energy x intensity (spec/carbon.py)."""

    country: StrictStr | None = None
    """ISO 3166-1 alpha-3 code (``FRA``): codecarbon's per-country table."""
    region: StrictStr | None = None
    """A cloud region, ``provider:region`` (``gcp:europe-west9``): codecarbon's cloud table."""
    g_per_kwh: Annotated[Amount, Field(ge=0)] | None = None
    """A figure of your own, in grams of CO2e per kWh."""

    @model_validator(mode="after")
    def _one_known_source(self) -> CarbonSpec:
        given = [k for k in ("country", "region", "g_per_kwh") if getattr(self, k) is not None]
        if len(given) != 1:
            raise _problem(
                f"give exactly one of country, region, g_per_kwh (got {len(given)})",
                NOTHING if not given else {k: getattr(self, k) for k in given},
                'write e.g. carbon: {country: FRA}, {region: "gcp:europe-west9"} or '
                "{g_per_kwh: 56}",
            )
        try:
            self.intensity()
        except carbon.UnknownArea as exc:
            key = given[0]
            raise _problem(str(exc), getattr(self, key), "use a code from the table", key) from exc
        return self

    def intensity(self) -> Intensity:
        if self.country is not None:
            return carbon.for_country(self.country)
        if self.region is not None:
            return carbon.for_region(self.region)
        assert self.g_per_kwh is not None
        return Intensity(float(self.g_per_kwh), "the cluster spec (carbon.g_per_kwh)")


class ClusterSpec(_Model):
    """A whole cluster: its node groups, storage, partitions and health/recovery policy."""

    name: ClusterName
    """Cluster name: lowercase letters, digits and dashes, at most 40 characters."""
    backend: Backend = "local"
    """``local`` runs nodes as processes on this machine; ``slurm`` runs them as Slurm jobs."""
    instance_groups: tuple[InstanceGroup, ...] = Field(min_length=1)
    """Node groups, in a stable order that fixes node naming (see :meth:`node_names`)."""
    controller: ControllerSpec = ControllerSpec()
    """Where the controller listens (127.0.0.1 on a free port by default) and its TLS."""
    storage: StorageSpec = StorageSpec()
    """Shared dir, node scratch and checkpoint location; all optional."""
    partitions: Annotated[tuple[Partition, ...], Field(min_length=1)] | None = None
    """Partitions as written; None means one partition ``default`` with every compute group.
    Use :meth:`effective_partitions` rather than reading this directly."""
    health: HealthPolicy = HealthPolicy()
    """Heartbeat interval and timeout."""
    recovery: RecoveryPolicy = RecoveryPolicy()
    """Teardown grace period and default restart budget."""
    preemption: PreemptionPolicy = PreemptionPolicy()
    """The notice signal and grace period a preempted job gets; its minimum run time."""
    slurm: SlurmSpec | None = None
    """With ``backend: slurm``: the slurm.conf and sbatch options for every job."""
    priority_classes: tuple[PriorityClassSpec, ...] = ()
    """Named priorities jobs submit with (``--priority-class``); none: all jobs equal."""
    teams: tuple[TeamSpec, ...] = ()
    """Teams with quotas per partition, fair-share weights and borrowing; none: no quotas."""
    users: tuple[UserSpec, ...] = ()
    """Users who get tokens (``trainpod users add``), their team and role."""
    fair_share: FairShareSpec = FairShareSpec()
    """How fast past usage stops counting against a team."""
    carbon: CarbonSpec | None = None
    """The grid's carbon intensity (country, cloud region or g/kWh); none: world average."""
    env_allow: tuple[EnvAllowEntry, ...] = DEFAULT_ENV_ALLOW
    """What of the agents' own environment reaches workers (names, or prefixes ending in
    ``*``); nothing else does (see :mod:`trainpod.spec.workerenv`)."""

    def carbon_intensity(self) -> Intensity:
        return self.carbon.intensity() if self.carbon is not None else world_average()

    @model_validator(mode="after")
    def _check_cross_fields(self) -> ClusterSpec:
        problems = _group_problems(self.instance_groups)
        problems += _partition_problems(self.instance_groups, self.partitions or ())
        problems += _backend_problems(self)
        problems += sharing_problems(self)
        if problems:
            raise SpecProblems(problems)
        return self

    def groups_by_name(self) -> dict[str, InstanceGroup]:
        """The instance groups keyed by name, in file order."""
        return {g.name: g for g in self.instance_groups}

    def effective_partitions(self) -> list[Partition]:
        """The partitions with defaults filled in; exactly one has ``default=True``.

        Without a ``partitions`` key: one partition ``default`` holding every compute group
        (spares included). Otherwise the written ones, the first marked default if none is.
        """
        if self.partitions is None:
            compute = tuple(g.name for g in self.instance_groups if g.role == "compute")
            return [Partition(name="default", groups=compute, default=True)]
        parts = list(self.partitions)
        if not any(p.default for p in parts):
            parts[0] = parts[0].model_copy(update={"default": True})
        return parts

    def default_partition(self) -> Partition:
        """The partition used by jobs that name none."""
        return next(p for p in self.effective_partitions() if p.default)

    def node_names(self) -> list[tuple[str, InstanceGroup]]:
        """Every node as ``(name, group)``: groups in file order, ``<group>-0`` upwards, or
        a group's Slurm node names when it has them."""
        from trainpod.slurm.hostlist import expand

        out: list[tuple[str, InstanceGroup]] = []
        for g in self.instance_groups:
            names = expand(g.slurm.nodes) if g.slurm else [f"{g.name}-{i}" for i in range(g.count)]
            out.extend((n, g) for n in names)
        return out

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``model_dump(mode="json")``) that parses back to an equal spec."""
        return self.model_dump(mode="json")


def _backend_problems(spec: ClusterSpec) -> list[SpecProblem]:
    problems: list[SpecProblem] = []
    if spec.backend == "slurm":
        for i, g in enumerate(spec.instance_groups):
            if g.spare:
                reason = "on Slurm, hot spares are per job, inside its allocation"
                fix = "remove `spare: true` and submit with `trainpod submit --spares K`"
                problems.append(SpecProblem(("instance_groups", i, "spare"), reason, True, fix))
        return problems
    if spec.slurm is not None:
        reason, fix = "only used with `backend: slurm`", "remove it or set `backend: slurm`"
        problems.append(SpecProblem(("slurm",), reason, NOTHING, fix))
    return problems


def _group_problems(groups: tuple[InstanceGroup, ...]) -> list[SpecProblem]:
    problems: list[SpecProblem] = []
    first_index: dict[str, int] = {}
    heads: list[int] = []
    for i, group in enumerate(groups):
        first = first_index.setdefault(group.name, i)
        if first != i:
            reason = f"duplicate group name, already used by instance_groups[{first}]"
            fix = "give each instance group a unique name"
            problems.append(SpecProblem(("instance_groups", i, "name"), reason, group.name, fix))
        if group.role == "head":
            heads.append(i)
    for i in heads[1:]:
        reason = f"one head node is supported; instance_groups[{heads[0]}] is the head"
        fix = "keep a single head group and set `role: compute` on the others"
        problems.append(SpecProblem(("instance_groups", i, "role"), reason, "head", fix))
    if not any(g.role == "compute" and not g.spare for g in groups):
        reason = "no compute group that is not a spare; jobs would have nowhere to run"
        fix = "add a group with `role: compute` and without `spare: true`"
        problems.append(SpecProblem(("instance_groups",), reason, [g.name for g in groups], fix))
    return problems


def _partition_problems(
    groups: tuple[InstanceGroup, ...], partitions: tuple[Partition, ...]
) -> list[SpecProblem]:
    problems: list[SpecProblem] = []
    compute = list(dict.fromkeys(g.name for g in groups if g.role == "compute"))
    hint = "name one of the compute groups: " + (", ".join(compute) or "(none)")
    names: set[str] = set()
    defaults: list[int] = []
    for i, part in enumerate(partitions):
        if part.name in names:
            fix = "give each partition a unique name"
            problems.append(
                SpecProblem(("partitions", i, "name"), "duplicate name", part.name, fix)
            )
        names.add(part.name)
        defaults += [i] if part.default else []
        seen: set[str] = set()
        for j, group in enumerate(part.groups):
            if group in compute and group not in seen:
                seen.add(group)
                continue
            if group in seen:
                reason, fix = "group listed twice in this partition", "list it once"
            elif any(g.name == group for g in groups):
                reason, fix = "names the head group; only compute groups run jobs", hint
            else:
                reason, fix = "no instance group has this name", hint
            problems.append(SpecProblem(("partitions", i, "groups", j), reason, group, fix))
    for i in defaults[1:]:
        reason = f"partitions[{defaults[0]}] is already the default"
        fix = "mark at most one partition `default: true`"
        problems.append(SpecProblem(("partitions", i, "default"), reason, True, fix))
    return problems


def _checkpoint_uri(value: str, info: ValidationInfo) -> str:
    example = "e.g. file:///data/ckpt, s3://bucket/prefix or a bare path"
    scheme, sep, rest = value.partition("://")
    if not sep:
        if not value.strip():
            raise _problem("empty checkpoint URI", value, f"remove the key or give one; {example}")
        return "file://" + str(_absolute(Path(value), info))
    if scheme == "s3" and not rest.split("/")[0]:
        raise _problem("an s3:// URI needs a bucket", value, "use s3://<bucket>/<prefix>")
    if scheme == "file" and not rest.startswith("/"):
        fix = f"write three slashes (file:///abs/path) or give a bare path; {example}"
        raise _problem("a file:// URI needs an absolute path", value, fix)
    if scheme not in ("file", "s3"):
        raise _problem(
            f"unsupported URI scheme {scheme!r}", value, f"use file:// or s3://; {example}"
        )
    return value
