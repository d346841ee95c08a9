"""The job spec: what a user submits."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from trainpod import resume
from trainpod.spec.parallelism import Parallelism, check_shape

_SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE")

_RESERVED_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PARTITION = re.compile(r"[a-z][a-z0-9-]{0,29}")  # the cluster spec's partition names
_SLURM_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\[\]-]{0,199}")
_SLURM_DEPENDENCY = re.compile(r"[A-Za-z0-9_:,?+*%.-]{1,400}")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
MAX_PRELOAD = 32
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NUL = re.compile(r"\x00")
_NO_NUL = "remove it: a process's arguments and environment end a string at NUL"
MAX_ARG = 128 * 1024  # Linux's MAX_ARG_STRLEN: execve refuses a longer argument


def _text(value: str, what: str, fix: str, *, control: bool = True) -> str:
    """``value`` if it can reach a process as it is: UTF-8, no NUL (``execve`` ends a string
    there), no control characters where ``control`` (a line break in a name or a Slurm
    option would start a new line of the batch script)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} is not valid UTF-8 (byte 0x{ord(value[exc.start]) & 0xFF:02x} at "
            f"{exc.start}); re-encode it as UTF-8: trainpod stores and passes text"
        ) from None
    bad = (_CONTROL if control else _NUL).search(value)
    if bad:
        raise ValueError(f"{what} holds the control character {bad.group()!r}; {fix}")
    if len(value) > MAX_ARG:
        raise ValueError(f"{what} is {len(value)} characters, more than {MAX_ARG}; {fix}")
    return value


RecoveryMode = Literal["restart", "in-process"]
RECOVERY_MODES: tuple[RecoveryMode, ...] = ("restart", "in-process")


class JobSpec(BaseModel):
    """A job as submitted: the command, its shape and its environment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: list[str] = Field(
        min_length=1, description="argv of every worker; run directly, never through a shell"
    )
    name: str = Field(default="", max_length=80, description="display name; default: argv[0..1]")
    nodes: int = Field(default=1, ge=1, le=1024, description="nodes allocated as one gang")
    procs_per_node: int | None = Field(
        default=None, ge=1, le=256, description="ranks per node; None = the node's device count"
    )
    partition: str | None = Field(default=None, description="None = the default partition")
    env: dict[str, str] = Field(default_factory=dict, description="extra worker environment")
    secret_env: dict[str, str] = Field(
        default_factory=dict,
        description="worker environment kept secret: stored apart from the spec, never listed"
        " or logged, shown as *** to the job's owner and admins and not at all to others",
    )
    workdir: str | None = Field(default=None, description="worker cwd; None = submitter's cwd")
    user: str = Field(
        default="", description="who submitted it: set by the controller from the caller's token"
    )
    team: str = Field(default="", description="the owner's team: set by the controller")
    account: str | None = Field(
        default=None, description="the POSIX account its ranks run as: set by the controller"
    )
    priority_class: str | None = Field(
        default=None, description="a priority class of the cluster; None = the team's default"
    )
    private: bool = Field(default=False, description="only its owner and admins may read its logs")
    auto_resume: bool = Field(default=False, description="restart automatically after a fault")
    max_restarts: int | None = Field(
        default=None, ge=0, description="None = the cluster's recovery.max_restarts"
    )
    recovery: RecoveryMode = Field(
        default="restart",
        description="how a fault is recovered: restart (every rank starts again) or in-process "
        "(healthy ranks keep running and re-join the failed rank's replacement; the script "
        "runs its loop with trainpod.elastic.run; ADR 0026)",
    )
    preload: list[str] = Field(
        default_factory=list,
        description="modules its ranks import that take long (transformers, lightning): "
        "each node's agent imports them once in a warm-start server for the job, and the "
        "ranks' later starts (restarts after a fault) fork from it with them imported; "
        "not for jobs that run as an account",
    )
    min_nodes: int | None = Field(
        default=None, ge=1, description="continue on this many nodes when no spare is left"
    )
    hang_timeout_s: float | None = Field(
        default=None, gt=0, description="no beacon for this long = hung; None = cluster's"
    )
    startup_timeout_s: float | None = Field(
        default=None, gt=0, description="hung if no first beacon by then; None = never"
    )

    spares: int = Field(
        default=0, ge=0, le=64, description="Slurm: extra nodes held as hot spares in the job"
    )
    time_limit: str | None = Field(
        default=None,
        description="--time, Slurm's format (e.g. 90, 2:00:00, 1-12): the job is stopped when "
        "it runs longer; schedulers use it to backfill and to estimate starts",
    )
    nice: int | None = Field(default=None, description="Slurm --nice")
    priority: int | None = Field(default=None, ge=0, description="Slurm --priority (admins)")
    dependency: str | None = Field(default=None, description="Slurm --dependency, verbatim")
    exclude: list[str] = Field(default_factory=list, description="Slurm nodes never to use")
    parallelism: Parallelism | None = Field(
        default=None,
        description="Megatron-style layout hint {tensor, pipeline}: checked against the "
        "job's shape (TP groups inside a node) and given to the ranks as TRAINPOD_TP/PP/DP "
        "and TRAINPOD_PARALLEL_ARGS (ADR 0038)",
    )
    interactive: bool = Field(
        default=False,
        description="an allocation held by `trainpod alloc` (embedded: hold processes, its "
        "shell and `trainpod run` steps; Slurm: salloc), not a batch job",
    )

    @field_validator("recovery", mode="before")
    @classmethod
    def _known_recovery(cls, value: object) -> object:
        if value not in RECOVERY_MODES:
            raise ValueError(
                f"--recovery {value!r} is not a recovery mode; use restart (the default: every "
                "rank starts again) or in-process (healthy ranks stay; the script runs its loop "
                "with trainpod.elastic.run)"
            )
        return value

    @model_validator(mode="after")
    def _in_process_needs_resume(self) -> JobSpec:
        if self.recovery == "in-process" and not self.auto_resume:
            raise ValueError(
                "--recovery in-process needs --auto-resume: a rank that cannot recover in "
                "process falls back to a full restart; add --auto-resume"
            )
        if self.recovery == "in-process" and self.interactive:
            raise ValueError(
                "--recovery in-process is for batch jobs; an allocation (trainpod alloc) "
                "has no training loop to recover: leave --recovery out"
            )
        return self

    @field_validator("preload")
    @classmethod
    def _module_names(cls, names: list[str]) -> list[str]:
        if len(names) > MAX_PRELOAD:
            raise ValueError(
                f"--preload names {len(names)} modules; at most {MAX_PRELOAD}: keep the few "
                "whose import takes seconds"
            )
        for name in names:
            if not isinstance(name, str) or not _MODULE.fullmatch(name) or len(name) > 200:
                raise ValueError(
                    f"--preload {name!r:.80} is not a module name; give dotted Python names "
                    "as `import` takes them (transformers, torch.distributed), comma-separated"
                )
        return list(dict.fromkeys(names))

    @field_validator("command")
    @classmethod
    def _command_text(cls, argv: list[str]) -> list[str]:
        for i, arg in enumerate(argv):
            _text(arg, f"argument {i} of the command", _NO_NUL, control=False)
        resume.check_command(argv)  # ``{resume:DIR}`` (ADR 0030)
        return argv

    @field_validator("name")
    @classmethod
    def _name_text(cls, value: str) -> str:
        return _text(value, "--name", "use printable text on one line")

    @field_validator("workdir")
    @classmethod
    def _workdir_text(cls, value: str | None) -> str | None:
        fix = "give an existing directory's path"
        return None if value is None else _text(value, "--workdir", fix)

    @field_validator("partition")
    @classmethod
    def _partition_name(cls, value: str | None) -> str | None:
        if value is not None and not _PARTITION.fullmatch(value):
            raise ValueError(
                f"--partition {value!r} is not a partition name; partitions are named with "
                "1-30 lowercase letters, digits and dashes, starting with a letter "
                "(`trainpod cluster info` lists them)"
            )
        return value

    @field_validator("dependency")
    @classmethod
    def _slurm_dependency(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_DEPENDENCY.fullmatch(value):
            raise ValueError(
                f"--dependency {value!r} is not a Slurm dependency; write e.g. afterok:123 or "
                "afterany:12:13,singleton (letters, digits and _:,?+*%.- only)"
            )
        return value

    @field_validator("exclude")
    @classmethod
    def _slurm_nodes(cls, value: list[str]) -> list[str]:
        for node in value:
            if not _SLURM_NODE.fullmatch(node):
                raise ValueError(
                    f"--exclude {node!r} is not a Slurm node name; write e.g. node4 or "
                    "gpu-[01-04] (letters, digits and _.-[] only), several joined by commas"
                )
        return value

    @field_validator("time_limit")
    @classmethod
    def _slurm_time(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_TIME.fullmatch(value):
            raise ValueError(
                f"--time {value!r} is not a Slurm time limit; use minutes, MM:SS, HH:MM:SS, "
                "D-HH, D-HH:MM or D-HH:MM:SS (e.g. 90 or 1:30:00)"
            )
        return value

    def slurm_only(self) -> list[str]:
        """The Slurm pass-through options this job sets (empty for a plain job)."""
        named = {
            "--spares": self.spares or None,
            "--nice": self.nice,
            "--priority": self.priority,
            "--dependency": self.dependency,
            "--exclude": self.exclude or None,
        }
        return [k for k, v in named.items() if v is not None]

    @model_validator(mode="after")
    def _min_nodes_fit(self) -> JobSpec:
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(
                f"--min-nodes {self.min_nodes} is more than --nodes {self.nodes}; "
                "min_nodes is the smallest size the job may shrink to"
            )
        return self

    @model_validator(mode="after")
    def _parallel_layout_fits(self) -> JobSpec:
        # Without --procs-per-node, admission checks it once it knows the node's devices.
        if self.parallelism is not None and self.procs_per_node is not None:
            check_shape(
                self.parallelism,
                nodes=self.nodes,
                min_nodes=self.min_nodes,
                procs_per_node=self.procs_per_node,
            )
        return self

    @field_validator("env", "secret_env")
    @classmethod
    def _no_contract_override(cls, env: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        option = "--secret-env" if info.field_name == "secret_env" else "--env"
        for key, value in env.items():
            if not _ENV_KEY.fullmatch(key):
                raise ValueError(
                    f"{option} key {key!r} is not a variable name; use letters, digits and "
                    "underscores, not starting with a digit (e.g. MY_VAR=1)"
                )
            _text(value, f"{option} {key}'s value", _NO_NUL, control=False)
        clash = sorted(set(env) & set(_RESERVED_ENV))
        if clash:
            raise ValueError(
                f"{option} may not set {', '.join(clash)}: trainpod sets these for every rank "
                "(the torchrun contract); remove them"
            )
        return env

    @model_validator(mode="after")
    def _secret_apart(self) -> JobSpec:
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(
                f"{', '.join(both)} given both with --env and --secret-env; keep one (a "
                "secret only with --secret-env)"
            )
        return self

    def time_limit_s(self) -> float | None:
        """``time_limit`` in seconds; None when unset or unlimited."""
        return None if self.time_limit is None else slurm_seconds(self.time_limit)

    def display_name(self) -> str:
        if self.name:
            return self.name
        parts = [p.rsplit("/", 1)[-1] for p in self.command[:2]]
        return " ".join(parts)[:80]


def slurm_seconds(value: str) -> float | None:
    """Seconds of a Slurm time limit (``minutes``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``,
    ``D-HH:MM``, ``D-HH:MM:SS``); None for ``UNLIMITED``/``INFINITE``."""
    if value in ("UNLIMITED", "INFINITE"):
        return None
    days = 0
    if "-" in value:
        d, value = value.split("-", 1)
        days = int(d)
        parts = [int(x) for x in value.split(":")]
        h, m, sec = [*parts, 0, 0][:3]
    else:
        parts = [int(x) for x in value.split(":")]
        if len(parts) == 1:
            h, m, sec = 0, parts[0], 0
        elif len(parts) == 2:
            h, m, sec = 0, parts[0], parts[1]
        else:
            h, m, sec = parts
    return float(((days * 24 + h) * 60 + m) * 60 + sec)
