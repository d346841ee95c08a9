"""Wire models: the agent protocol and the public API's responses.

These are shared by the controller, the agent and the client, and import nothing heavier
than pydantic.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trainpod.api.devices import DeviceSample
from trainpod.bounded import ByteBoundedCache
from trainpod.model.states import AttemptState, JobState, NodeState, RankState
from trainpod.spec.job import JobSpec


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- agent protocol ---------------------------------------------------------------------
class RankReport(_Model):
    rank: int
    local_rank: int
    pid: int | None = None
    state: Literal["running", "exited"]
    exit_code: int | None = None
    signal: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    log_tail: str = ""
    idle_s: float | None = Field(
        default=None,
        description="seconds the running rank (with its children) has used no CPU, as its "
        "agent measured it; null while it works",
    )


class RankBeacon(_Model):
    """What a rank's progress beacons say, as summarised by its agent."""

    rank: int
    first_at: float
    last_at: float
    age_s: float = Field(description="seconds since the last beacon, by the agent's clock")
    first_step: int | None = None
    last_step: int | None = None
    steps: int = 0
    step_time_s: float | None = None
    last_checkpoint_step: int | None = None
    checkpoint_stall_s: float = 0.0
    metrics: dict[str, Any] = Field(default_factory=dict)
    generation: int = Field(
        default=0, description="the in-process recovery generation the rank last joined"
    )
    lost_generation: int | None = Field(
        default=None,
        description="the newest generation whose process group the rank lost (a collective "
        "failed or timed out) and waits to leave for the next one",
    )
    collective_timeout_s: float | None = Field(
        default=None, description="the collective timeout of the rank's process group"
    )


class AttemptReport(_Model):
    attempt_id: int
    job_id: int
    ranks: list[RankReport]
    beacons: list[RankBeacon] = Field(default_factory=list)


class HealthResult(_Model):
    check: str
    status: Literal["ok", "warn", "fault"]
    reason: str
    simulated: bool = False
    facts: dict[str, Any] = Field(default_factory=dict)


class DeepCheckResult(_Model):
    id: str
    status: Literal["running", "ok", "warn", "fault"]
    reason: str = ""
    facts: dict[str, Any] = Field(default_factory=dict)


class LifecycleResult(_Model):
    script: str
    state: Literal["pending", "running", "ok", "failed", "timeout"]
    exit_code: int | None = None
    duration_s: float | None = None
    log_path: str = ""
    tail: str = ""


class LifecycleStatus(_Model):
    state: Literal["running", "ok", "failed"]
    results: list[LifecycleResult] = Field(default_factory=list)


class CheckpointReport(_Model):
    """What happened to one step of a job's checkpoint in one tier, on the reporting node.

    Sent by the agent until the controller has recorded it (at least once)."""

    job_id: int
    attempt_id: int | None = Field(default=None, description="the attempt that saved the step")
    step: int
    tier: str = Field(description="memory, scratch, peer, durable")
    scope: Literal["node", "job"] = Field(
        default="node", description="job: the tier holds every node's part (durable)"
    )
    ok: bool
    saved: bool = Field(default=False, description="the memory-tier commit of a save()")
    bytes: int = 0
    seconds: float = Field(default=0.0, description="this node's copy into the tier")
    since_save_s: float | None = Field(default=None, description="from the snapshot to here")
    stall_s: float | None = Field(default=None, description="the longest save() stall of a rank")
    reason: str = ""
    wrote_manifest: bool = False
    skipped: int = Field(
        default=0, ge=0, description="memory-tier steps this tier skipped since its last commit"
    )
    full: bool = Field(
        default=False, description="the tier was full or unwritable: the step went to to_tier"
    )
    to_tier: str | None = Field(default=None, description="full: where the step went (none)")
    path: str = Field(default="", description="full: the tier's directory on the node")
    needed_bytes: int = Field(default=0, ge=0, description="full: the node's part of the step")
    free_bytes: int | None = Field(default=None, description="full: free on the tier's disk")
    at: float = Field(default=0.0, description="the agent's wall clock")


class CheckpointUpload(_Model):
    """Where a job's checkpoint persister on the reporting node stands."""

    job_id: int
    done_through: int | None = None
    committed: dict[str, int | None] = Field(default_factory=dict)
    copying_step: int | None = None
    copying_tier: str | None = None
    bytes_done: int = 0
    bytes_total: int = 0
    rate_bps: float = 0.0
    retry_in_s: float | None = None
    errors: dict[str, str] = Field(default_factory=dict)
    steps_skipped: dict[str, int] = Field(
        default_factory=dict, description="tier -> steps it skipped (busy with an older one)"
    )


FORGOTTEN_MAX = 64  # attempts a heartbeat lists as forgotten, at most
FORGOTTEN_FOR_S = 60.0  # how long an agent lists an attempt it has forgotten


class Heartbeat(_Model):
    """What an agent sends about once a second, and at once when a worker exits."""

    node: str
    agent_id: str = Field(description="unique per agent process; a new one means a restart")
    agent_pid: int
    address: str
    facts: dict[str, Any] = Field(default_factory=dict)
    lifecycle: LifecycleStatus
    attempts: list[AttemptReport] = Field(default_factory=list)
    forgotten: list[int] = Field(
        default_factory=list,
        max_length=FORGOTTEN_MAX,
        description=(
            "attempts this agent ran and has since forgotten (every rank's exit"
            " acknowledged), in the last minute, read with ``attempts``: a rank of one that"
            " the controller still holds live was lost (its exit never reached it)"
        ),
    )
    orders_hash: str | None = Field(
        default=None, description="hash of the orders the agent holds; the reply waits for new"
    )
    wait_s: float = Field(default=0.0, ge=0, le=30)
    leaving: bool = Field(default=False, description="the agent is shutting down on purpose")
    health: list[HealthResult] = Field(default_factory=list)
    deep_check: DeepCheckResult | None = None
    chaos_done: list[str] = Field(default_factory=list, description="chaos order ids executed")
    time: float = Field(default=0.0, description="the agent's wall clock when it sent this")
    checkpoints: list[CheckpointReport] = Field(default_factory=list)
    checkpoint_uploads: list[CheckpointUpload] = Field(default_factory=list)
    allocation: int | None = Field(
        default=None, description="Slurm: the trainpod job whose allocation runs this agent"
    )
    allocation_round: int = Field(default=0, description="Slurm: the job's restart count")
    external_id: str | None = Field(default=None, description="Slurm: SLURM_JOB_ID")
    preempted_at: float | None = Field(
        default=None,
        description="Slurm: when Slurm's preemption notice reached this agent's allocation",
    )
    group: str | None = Field(default=None, description="the node's group (Slurm nodes)")
    devices: int | None = Field(default=None, description="the node's devices (Slurm nodes)")
    telemetry: list[DeviceSample] = Field(
        default_factory=list, description="device telemetry (api/devices.py); read by intake"
    )


class RankSlot(_Model):
    rank: int
    local_rank: int


class LaunchOrder(_Model):
    attempt_id: int
    job_id: int
    attempt_number: int
    argv: list[str]
    workdir: str
    env: dict[str, str]
    ranks: list[RankSlot]
    log_dir: str
    account: str | None = Field(
        default=None, description="the POSIX account the ranks run as (None: the agent's)"
    )
    preload: list[str] = Field(
        default_factory=list,
        description="modules the agent imports in a warm-start server of the job's own (its "
        "spec's preload), for the ranks' later starts to fork from",
    )


class KillOrder(_Model):
    """Stop an attempt's ranks: SIGTERM, then SIGKILL after ``grace_s``. A preempted
    attempt's order carries a notice: first ``notice_signal`` (a signal name) to every rank's
    process group, after the notice file is written; ``notice_grace_s`` for the ranks to exit
    on their own; only then the SIGTERM."""

    attempt_id: int
    grace_s: float
    reason: str
    notice_signal: str | None = None
    notice_grace_s: float = 0.0


class RecoverOrder(_Model):
    """Re-form an in-process-recovery attempt's process group (ADR 0026): publish the
    recover message to the node's ranks, and start ``respawn`` (this node's ranks among
    ``replaced``) again in the same attempt, with the new group's facts."""

    attempt_id: int
    generation: int = Field(ge=1)
    master_addr: str
    master_port: int = Field(gt=0, lt=65536)
    world_size: int = Field(ge=1)
    replaced: list[int] = Field(default_factory=list, description="every rank started fresh")
    respawn: list[int] = Field(default_factory=list, description="of those, this node's")
    deadline_s: float = Field(default=60.0, gt=0)


class DeepCheckOrder(_Model):
    id: str
    timeout_s: float


ChaosFault = Literal[
    "kill-worker",
    "kill-agent",
    "hang",
    "xid79",
    "ecc",
    "thermal",
    "disk-full",
    "slow",
]


class ChaosOrder(_Model):
    id: str
    fault: ChaosFault
    rank: int | None = None


class Orders(_Model):
    launch: list[LaunchOrder] = Field(default_factory=list)
    kill: list[KillOrder] = Field(default_factory=list)
    recover: list[RecoverOrder] = Field(default_factory=list)
    deep_check: DeepCheckOrder | None = None
    chaos: list[ChaosOrder] = Field(default_factory=list)
    heartbeat_interval_s: float = 1.0
    active_jobs: list[int] | None = Field(
        default=None,
        description="jobs that have run on this node and have not ended (None: not said);"
        " the agent removes the shared-memory checkpoints of any other",
    )
    leave: int | None = Field(
        default=None, description="Slurm: the allocation's job ended; exit with this code"
    )
    stores: list[int] = Field(
        default_factory=list,
        description="attempts not ended whose rendezvous store this node's agent hosts"
        " (the node of group rank 0; ADR 0028); the agent closes the store of any other",
    )
    controller_time: float = Field(default=0.0, description="not part of the hash")
    hash: str = ""

    def sealed(self) -> Orders:
        """These orders with their hash (the agent echoes it; a long poll waits while the
        agent holds orders of the same hash)."""
        # Most orders are the same as many before (a thousand idle nodes get the same
        # "nothing to do"): their canonical JSON (sorted keys) is hashed once, and the sealed
        # orders kept, looked up by pydantic's own (fast) dump of them. Kept orders are
        # shared: nothing changes orders once made (the reply's time goes on a copy).
        key = self.model_dump_json(exclude=_UNHASHED)
        kept = _SEALED.get(key)
        if kept is not None and kept.controller_time == self.controller_time:
            return kept
        body = json.dumps(self.model_dump(exclude=_UNHASHED), sort_keys=True)
        digest = hashlib.sha256(body.encode()).hexdigest()[:16]
        sealed = self.model_copy(update={"hash": digest})
        _SEALED.put(key, sealed, SEALED_BYTES_PER_CHAR * len(key))
        return sealed


_UNHASHED = {"hash", "controller_time"}
SEALED_BYTES = 32 << 20
SEALED_BYTES_PER_CHAR = 4
"""A kept entry weighs about four times its key: the key itself (the orders' JSON) and the
orders as models, which take about three times their JSON (as job specs do: see
``trainpod.controller.views``)."""
SEALED_BYTES_PER_NODE = 32 << 10
"""About six launch orders a node: every node's current orders stay kept, whatever the size."""
SEALED_BYTES_MIN = 2 << 20
_SEALED: ByteBoundedCache[str, Orders] = ByteBoundedCache(SEALED_BYTES)
"""Orders' JSON (unhashed fields excluded) -> them, sealed."""


def sealed_bytes_for(nodes: int) -> int:
    """The sealed orders' bound for a cluster of ``nodes``: what a hit needs is each node's
    current orders, so the bound follows the nodes, from SEALED_BYTES_MIN to SEALED_BYTES
    (1,024 nodes); a small cluster does not keep 32 MiB of orders no node holds any more."""
    return max(SEALED_BYTES_MIN, min(SEALED_BYTES, nodes * SEALED_BYTES_PER_NODE))


def size_sealed_orders(nodes: int) -> None:
    """Bound the process's sealed orders for a cluster of ``nodes`` (the controller's start)."""
    _SEALED.resize(sealed_bytes_for(nodes))


# -- public API ---------------------------------------------------------------------------
class NodeInfo(_Model):
    name: str
    group: str
    role: str
    spare: bool
    devices: int
    state: NodeState
    reason: str
    job_id: int | None
    address: str | None
    agent_pid: int | None
    last_heartbeat: float | None
    facts: dict[str, Any]
    drained: bool = False
    repairs: int = 0
    allocation: int | None = None


class RankInfo(_Model):
    rank: int
    node: str
    local_rank: int
    state: RankState
    pid: int | None
    exit_code: int | None
    signal: int | None
    started_at: float | None
    ended_at: float | None


class AttemptInfo(_Model):
    number: int
    state: AttemptState
    nodes: list[str]
    master_addr: str
    master_port: int
    created_at: float
    started_at: float | None
    ended_at: float | None
    cause: str = Field(description="why it stopped, as first detected")
    failure: dict[str, Any]
    ranks: list[RankInfo] = Field(default_factory=list)
    fault: str = Field(
        default="",
        description="the fault it ended of once classified (a crash whose node died is "
        "node_lost); equals cause when nothing changed, empty when no fault",
    )
    generation: int = Field(
        default=0,
        description="its process group's generation: how often it was recovered in process "
        "(ADR 0026/0035); 0: never",
    )
    lent_by: list[int] = Field(
        default_factory=list,
        description="waiting jobs whose reserved nodes it started on (ADR 0050): each may "
        "preempt it once it can start",
    )
    generation_confirmed: bool = Field(
        default=True,
        description="every rank beaconed that it joined the newest generation (False while "
        "one is being formed)",
    )


class JobInfo(_Model):
    id: int
    name: str
    state: JobState
    reason: str
    spec: JobSpec
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    attempts: list[AttemptInfo] = Field(default_factory=list)
    external: str = Field(default="", description="the job's id in Slurm, if any")
    progress: dict[str, Any] | None = Field(
        default=None, description="the running attempt's progress beacons, summarised"
    )
    queue_position: int | None = Field(
        default=None, description="waiting jobs: 1-based place in scheduling order"
    )
    estimated_start: float | None = Field(
        default=None, description="waiting jobs: when it is expected to start, if known"
    )


class EventInfo(_Model):
    id: int
    ts: float
    kind: str
    node: str | None
    job_id: int | None
    attempt: int | None
    data: dict[str, Any]


class ClusterInfo(_Model):
    name: str
    backend: str
    controller_pid: int
    started_at: float
    nodes: dict[str, int] = Field(description="node count by state")
    jobs: dict[str, int] = Field(description="job count by state")
    partitions: dict[str, list[str]]
    shared_dir: str
    scratch_root: str
    checkpoint_uri: str
    step_failures_in_a_row: int = Field(
        default=0, description="reconcile steps failed in a row now (0: the loop is healthy)"
    )
    step_failures: int = Field(default=0, description="reconcile steps failed since start")
    last_step_error: str = Field(default="", description="the last failed step's error")
    last_step_error_at: float | None = None


class LaunchPlan(_Model):
    """What a submission would do, without doing it (``--dry-run``)."""

    job: JobSpec
    partition: str
    nodes: list[str]
    orders: dict[str, LaunchOrder]
    note: str = ""
    batch_script: str | None = Field(
        default=None, description="Slurm: the script sbatch would be given"
    )


class NodeAction(_Model):
    action: Literal["drain", "quarantine", "resume", "replace"]
    reason: str = Field(min_length=1, description="why: recorded in the node and its events")


class PreemptRequest(_Model):
    reason: str = Field(default="", description="why: shown as the job's reason and event")
    grace_s: float | None = Field(
        default=None, ge=0, allow_inf_nan=False, description="notice → teardown (default: spec)"
    )


class ChaosRequest(_Model):
    node: str
    fault: ChaosFault
    rank: int | None = Field(default=None, description="which rank (default: the node's first)")


class LogChunk(_Model):
    job_id: int
    attempt: int
    rank: int
    offset: int
    data: str
    job_ended: bool


# -- interactive work: `trainpod alloc`, `trainpod shell`, `trainpod run` ------------------
class AllocationLease(_Model):
    """The reply to a lease renewal: the allocation stands while its CLI keeps renewing."""

    job_id: int
    state: JobState
    reason: str
    lease_s: float = Field(description="unrenewed for this long, the allocation is released")
    renew_every_s: float = Field(description="how often the CLI should renew")
    ends_in_s: float | None = Field(default=None, description="time left under --time")


class ShellContext(_Model):
    """What a shell on a node (and, for a job, in that job) needs: spawned by the CLI."""

    node: str
    job_id: int | None = None
    env: dict[str, str] = Field(description="the variables a rank there gets (no RANK)")
    cwd: str = Field(description="the node's scratch dir (the job's, for a job)")
    devices: dict[str, Any] = Field(default_factory=dict, description="the node's devices")
    simulated: bool = Field(default=False, description="CPU slots stand in for GPUs")
    note: str = ""
    account: str | None = Field(
        default=None,
        description="the caller's POSIX account: a CLI that runs as root starts the shell as "
        "it (uid, gid, groups, HOME, a clean environment); None: as the CLI's user",
    )


class StepRequest(_Model):
    """``trainpod run CMD`` inside an allocation: CMD as ranks on its nodes."""

    command: list[str] = Field(min_length=1)
    procs_per_node: int | None = Field(
        default=None, ge=1, le=256, description="None = the node's device count"
    )
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None


class StepPlan(_Model):
    """One step of an allocation: a launch order per node, the torchrun contract set."""

    job_id: int
    step: int
    nodes: list[str]
    orders: dict[str, LaunchOrder]
    note: str = ""


class StepEnd(_Model):
    exit_code: int


# -- users and tokens -------------------------------------------------------------------------
class TokenInfo(_Model):
    id: str
    created_at: float
    revoked_at: float | None


class UserInfo(_Model):
    name: str
    team: str | None
    role: str
    account: str | None = Field(description="the POSIX account their work runs as")
    source: str = Field(description="spec (declared in the cluster spec) or cli (users add)")
    tokens: list[TokenInfo] = Field(default_factory=list)


class NewToken(_Model):
    """``POST /v1/users``: a token for a user (added if the spec does not declare them)."""

    name: str = Field(pattern=r"^[a-z_][a-z0-9_.-]{0,31}$", description="a POSIX user name")
    team: str | None = None
    role: Literal["user", "admin"] = "user"


class IssuedToken(_Model):
    user: UserInfo
    token_id: str
    token: str = Field(description="shown once; only its hash is kept")


class RevokeRequest(_Model):
    token_id: str | None = Field(default=None, description="None: every live token")


class Whoami(_Model):
    name: str
    role: str
    team: str | None
    account: str | None
