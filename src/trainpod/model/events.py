"""The event log's types: one frozen dataclass per kind of row in the append-only table.

Producers build an event and hand it to ``Store.append(ts, event)``; consumers read rows
(``EventRow`` from the store, ``EventInfo`` from the API) back with :func:`parse` and match
on the classes, never on kind strings or ``.get()`` on payload dicts.

Dataclasses, not pydantic: events are built on the controller's hot path (every heartbeat
writes some), and reading is already tolerant by hand (below), which pydantic would make
strict or need validators for. The cost is this module's small decoder, driven by the type
hints, so each class is written once.

**On disk** (byte-compatible with what ``Store.add_event`` has always written): the columns
``node``, ``job_id`` and ``attempt`` are fields of the classes that have them; every other
field is a key of the JSON ``data`` (``json.dumps(sort_keys=True)``). Enums are written as
their values, tuples as lists. A field marked ``omit_none`` is left out of the payload when
it is None, as some producers did with optional keys (``log_tail`` of a clean exit).

**Reading** never raises. A row's value that is missing or of the wrong type becomes the
field's default; a field typed ``X | None`` without a default (producers must give it)
reads as None. A row that lacks a field with neither (the event's identity: a state
change's ``new``, a rank event's ``rank``) or whose kind is not known here reads as
:class:`UnknownEvent`, with the raw data. Numbers that are not finite count as missing.

**One word per idea.** Attribute names differ from the payload keys where the keys used
several words for one idea (or one word for several); the keys stay as they are on disk:

============================  =============================  ============================
attribute                     payload key                    meaning
============================  =============================  ============================
``cause``                     ``fault`` (fault_detected,     the machine-readable class of
                              fault_classified), ``cause``   what went wrong: a fault kind
                              (attempt_state)                (crash, node_lost, ...) or why
                                                             an attempt ended without one
                                                             (cancelled, external)
``previous_cause``            ``was`` (fault_classified)     the cause before the fault
                                                             was classified
``reason``                    ``reason``; ``restart_reason`` the sentence a person reads
                              (attempt_created)
``check_id`` / ``order_id``   ``id`` (deep_check_started /   not to be confused with the
                              chaos_injected)                row's id
``external_state``            ``was`` (external_reaped)      the job's state in Slurm
============================  =============================  ============================

The controller's ``Fault.kind`` is this module's ``cause``. ``fault`` on
:class:`ChaosInjected` is a different idea: the fault chaos injected (``ChaosFault``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, TypeVar

from trainpod.model.codec import BAD, FieldCodec, codecs_of, plain
from trainpod.model.states import AttemptState, JobState, NodeState


class EventLike(Protocol):
    """A row of the event log, as the store (``EventRow``) or the API (``EventInfo``) has it."""

    @property
    def kind(self) -> str: ...
    @property
    def node(self) -> str | None: ...
    @property
    def job_id(self) -> int | None: ...
    @property
    def attempt(self) -> int | None: ...
    @property
    def data(self) -> dict[str, Any]: ...


class StoredEventLike(EventLike, Protocol):
    @property
    def id(self) -> int: ...
    @property
    def ts(self) -> float: ...


_CODECS: dict[type, tuple[FieldCodec, ...]] = {}


class _Base:
    """What every event has: its row's columns and payload."""

    __slots__ = ()

    def columns(self) -> tuple[str | None, int | None, int | None]:
        """``(node, job_id, attempt)``, the row's columns (None where the kind has none)."""
        return (
            getattr(self, "node", None),
            getattr(self, "job_id", None),
            getattr(self, "attempt", None),
        )

    def to_row_data(self) -> dict[str, Any]:
        """The JSON payload, exactly as the kind has always been written."""
        out: dict[str, Any] = {}
        for f in _CODECS[type(self)]:
            if f.column:
                continue
            value = getattr(self, f.name)
            if value is None and f.omit_none:
                continue
            out[f.key] = plain(value)
        return out


class KnownEvent(_Base):
    """An event of a kind this module knows; ``kind`` is the row's kind string."""

    __slots__ = ()
    kind: ClassVar[str]


@dataclass(frozen=True, kw_only=True)
class UnknownEvent(_Base):
    """A row of a kind not known here (written by a newer trainpod), or one that lacks what
    its kind needs. Kept whole, so it can be shown or appended again as it was."""

    kind: str
    node: str | None = None
    job_id: int | None = None
    attempt: int | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_row_data(self) -> dict[str, Any]:
        return dict(self.data)


_CODECS[UnknownEvent] = ()


Event = KnownEvent | UnknownEvent


@dataclass(frozen=True)
class Recorded:
    """An event as it was recorded: the row's id and time, and what happened."""

    id: int
    ts: float
    event: Event


def _key(key: str) -> dict[str, Any]:
    """Field metadata: stored under another payload key (see the module docstring)."""
    return {"key": key}


_OMIT_NONE = {"omit_none": True}
"""Field metadata: a payload key written only when it has a value."""


# -- the kinds ---------------------------------------------------------------------------
EVENT_TYPES: dict[str, type[KnownEvent]] = {}
"""Every known kind string -> its class (the registry :func:`parse` reads)."""

_E = TypeVar("_E", bound=type[KnownEvent])


def _register(cls: _E) -> _E:
    kind = cls.__dict__.get("kind")
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{cls.__name__} needs a class-level kind string")
    if kind in EVENT_TYPES:
        raise TypeError(f"{cls.__name__}: kind {kind!r} is {EVENT_TYPES[kind].__name__}'s")
    EVENT_TYPES[kind] = cls
    _CODECS[cls] = codecs_of(cls)
    return cls


# Nodes and agents ------------------------------------------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class NodeStateChanged(KnownEvent):
    kind = "node_state"
    node: str
    old: NodeState | None
    new: NodeState
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class NodeDeclared(KnownEvent):
    """A node became known: from the cluster spec, or a Slurm node whose agent said hello."""

    kind = "node_declared"
    node: str
    group: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class NodeAllocated(KnownEvent):
    """Slurm: a node of the job's allocation came up (its agent runs inside it)."""

    kind = "node_allocated"
    node: str
    job_id: int


@_register
@dataclass(frozen=True, kw_only=True)
class NodeReleased(KnownEvent):
    kind = "node_released"
    node: str
    job_id: int


@_register
@dataclass(frozen=True, kw_only=True)
class AgentRegistered(KnownEvent):
    """A new agent instance on the node (``restarted``: the node had one before)."""

    kind = "agent_registered"
    node: str
    agent_pid: int | None
    address: str | None
    restarted: bool = False


@_register
@dataclass(frozen=True, kw_only=True)
class AgentReconnected(KnownEvent):
    """A known agent heard from again by a restarted controller."""

    kind = "agent_reconnected"
    node: str


@_register
@dataclass(frozen=True, kw_only=True)
class DeepCheckStarted(KnownEvent):
    kind = "deep_check_started"
    node: str
    check_id: str = field(metadata=_key("id"))


@_register
@dataclass(frozen=True, kw_only=True)
class DeepCheckFinished(KnownEvent):
    kind = "deep_check_finished"
    node: str
    status: str
    """ok, warn or fault."""
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class NodeRepaired(KnownEvent):
    kind = "node_repaired"
    node: str
    mode: str | None
    """How: the repair's mode (reboot, replace, ...), None when not known."""


@_register
@dataclass(frozen=True, kw_only=True)
class ExternalNodeDown(KnownEvent):
    """Slurm reports the node DOWN or DRAINED by someone else."""

    kind = "external_node_down"
    node: str
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class NodeOperatorAction(KnownEvent):
    """An operator's ``trainpod nodes drain|quarantine|resume|replace``, with their reason."""

    action: ClassVar[str]
    node: str
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class NodeDrain(NodeOperatorAction):
    kind = "node_drain"
    action = "drain"


@_register
@dataclass(frozen=True, kw_only=True)
class NodeQuarantine(NodeOperatorAction):
    kind = "node_quarantine"
    action = "quarantine"


@_register
@dataclass(frozen=True, kw_only=True)
class NodeResume(NodeOperatorAction):
    kind = "node_resume"
    action = "resume"


@_register
@dataclass(frozen=True, kw_only=True)
class NodeReplace(NodeOperatorAction):
    kind = "node_replace"
    action = "replace"


NODE_ACTIONS: dict[str, type[NodeOperatorAction]] = {
    c.action: c for c in (NodeDrain, NodeQuarantine, NodeResume, NodeReplace)
}
"""``NodeAction.action`` -> its event class (the row kind is ``node_<action>``)."""


# The controller and jobs -----------------------------------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class ControllerStarted(KnownEvent):
    kind = "controller_started"
    restarted: bool = False


@_register
@dataclass(frozen=True, kw_only=True)
class ControllerStepFailed(KnownEvent):
    """The reconcile step started failing; the controller backs off until it recovers."""

    kind = "controller_step_failed"
    error: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class ControllerStepRecovered(KnownEvent):
    """The reconcile step works again, after ``failures`` failures in a row."""

    kind = "controller_step_recovered"
    failures: int = 0


@_register
@dataclass(frozen=True, kw_only=True)
class JobSubmitted(KnownEvent):
    kind = "job_submitted"
    job_id: int
    nodes: int | None
    procs_per_node: int | None
    partition: str | None
    user: str = ""
    command: tuple[str, ...] = ()
    auto_resume: bool = False


@_register
@dataclass(frozen=True, kw_only=True)
class CancelRequested(KnownEvent):
    kind = "cancel_requested"
    job_id: int


@_register
@dataclass(frozen=True, kw_only=True)
class JobStateChanged(KnownEvent):
    kind = "job_state"
    job_id: int
    old: JobState | None
    new: JobState
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class JobFirstStart(KnownEvent):
    """The job's first attempt has every rank running (written once per job)."""

    kind = "job_first_start"
    job_id: int


@_register
@dataclass(frozen=True, kw_only=True)
class JobPreempted(KnownEvent):
    """The scheduler (or an admin) preempted the job's running attempt: its ranks get the
    notice, then it stops and waits in the queue as ``preempted``."""

    kind = "job_preempted"
    job_id: int
    attempt: int
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class ChaosInjected(KnownEvent):
    kind = "chaos_injected"
    node: str
    job_id: int | None
    fault: str
    """What was injected (a ``ChaosFault``: kill-worker, xid79, ...)."""
    rank: int | None
    order_id: str = field(default="", metadata=_key("id"))


# Attempts and ranks ----------------------------------------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class AttemptCreated(KnownEvent):
    kind = "attempt_created"
    job_id: int
    attempt: int
    attempt_id: int | None
    nodes: tuple[str, ...] = ()
    master_addr: str | None
    master_port: int | None
    reason: str = field(default="", metadata=_key("restart_reason"))
    """Why this attempt was started: empty for the first, else ``"<cause>: <reason>"``."""
    lent_by: tuple[int, ...] | None = field(default=None, metadata=_OMIT_NONE)
    """The waiting jobs whose reserved nodes it was started on (ADR 0050); None: none."""


@_register
@dataclass(frozen=True, kw_only=True)
class AttemptStateChanged(KnownEvent):
    kind = "attempt_state"
    job_id: int
    attempt: int
    old: AttemptState | None
    new: AttemptState
    cause: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class AttemptProgress(KnownEvent):
    """How far an ended attempt got, from its ranks' beacons (``progress.summarise``)."""

    kind = "attempt_progress"
    job_id: int
    attempt: int
    first_step: int | None
    last_step: int | None
    """The step every rank finished."""
    first_beacon_at: float | None
    last_beacon_at: float | None
    step_time_s: float | None
    """The median step time of the ranks."""
    steps: int = 0
    last_checkpoint_step: int | None
    checkpoint_stall_s: float = 0.0
    ranks: int = 0


@_register
@dataclass(frozen=True, kw_only=True)
class RankStarted(KnownEvent):
    kind = "rank_started"
    node: str | None
    job_id: int
    attempt: int
    rank: int
    pid: int | None
    started_at: float | None
    """By the agent's clock."""


@_register
@dataclass(frozen=True, kw_only=True)
class RankExited(KnownEvent):
    kind = "rank_exited"
    node: str | None
    job_id: int
    attempt: int
    rank: int
    exited_at: float | None
    exit_code: int | None
    signal: int | None
    log_tail: str | None = field(default=None, metadata=_OMIT_NONE)
    """The end of its log; written only for a rank that failed."""


@_register
@dataclass(frozen=True, kw_only=True)
class RankLost(KnownEvent):
    """A rank whose node or agent went away: its fate is unknown."""

    kind = "rank_lost"
    node: str | None
    job_id: int
    attempt: int
    rank: int
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class FirstBeacon(KnownEvent):
    """The attempt's first progress beacon (of any rank)."""

    kind = "first_beacon"
    node: str | None
    job_id: int
    attempt: int
    rank: int | None
    at: float | None
    """By the agent's clock."""
    step: int | None


@_register
@dataclass(frozen=True, kw_only=True)
class StragglerDetected(KnownEvent):
    kind = "straggler_detected"
    node: str | None
    job_id: int
    attempt: int
    rank: int
    step_time_s: float | None


@_register
@dataclass(frozen=True, kw_only=True)
class RanksLeftIdle(KnownEvent):
    """Ranks still running, idle, ``waited_s`` after every other rank exited 0: stopped as
    stuck in their teardown; their attempt counts as a success (ADR 0049)."""

    kind = "ranks_left_idle"
    job_id: int
    attempt: int
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    waited_s: float


# Faults and recovery ---------------------------------------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class FaultDetected(KnownEvent):
    """An attempt's fault, once per attempt, with when it really happened."""

    kind = "fault_detected"
    job_id: int
    attempt: int
    node: str | None
    cause: str = field(default="", metadata=_key("fault"))
    fault_at: float | None
    reason: str = ""
    rank: int | None
    nodes: tuple[str, ...] = ()


@_register
@dataclass(frozen=True, kw_only=True)
class FaultClassified(KnownEvent):
    """What an attempt's fault turned out to be, when that differs from what was detected
    (a crash on a node that then went silent is ``node_lost``)."""

    kind = "fault_classified"
    job_id: int
    attempt: int
    node: str | None
    cause: str = field(default="", metadata=_key("fault"))
    previous_cause: str = field(default="", metadata=_key("was"))
    nodes: tuple[str, ...] = ()
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class RecoveryDecision(KnownEvent):
    """What the recovery policy decided for a failed attempt.

    ``action`` is restart, wait, fail or requeue (Slurm). ``replaced``, ``counts`` and
    ``shrunk`` come with restart, ``exclude`` with requeue."""

    kind = "recovery_decision"
    job_id: int
    attempt: int
    action: str
    reason: str = ""
    nodes: tuple[str, ...] = ()
    replaced: dict[str, str] | None = field(default=None, metadata=_OMIT_NONE)
    """Bad node -> its replacement."""
    counts: bool | None = field(default=None, metadata=_OMIT_NONE)
    """Whether it counts against max_restarts."""
    shrunk: bool | None = field(default=None, metadata=_OMIT_NONE)
    exclude: tuple[str, ...] | None = field(default=None, metadata=_OMIT_NONE)


@_register
@dataclass(frozen=True, kw_only=True)
class InProcessRecoveryStarted(KnownEvent):
    """A job with ``recovery: in-process`` keeps its attempt after a rank failed (ADR 0026):
    the attempt's group is re-formed as ``generation`` on ``master_port``, the ``replaced``
    ranks start again in it, the others stay. Given up at ``deadline_s`` from now."""

    kind = "in_process_recovery_started"
    job_id: int
    attempt: int
    node: str | None
    generation: int
    rank: int
    replaced: tuple[int, ...]
    master_port: int
    deadline_s: float
    reason: str = ""
    moved: dict[str, str] | None = field(default=None, metadata=_OMIT_NONE)
    """A lost node -> the node its ranks start on (a hot spare first; ADR 0035)."""


@_register
@dataclass(frozen=True, kw_only=True)
class InProcessRecoveryDone(KnownEvent):
    """Every rank beaconed that it joined ``generation`` (ADR 0035): ``duration_s`` from the
    fault to the last of those beacons."""

    kind = "in_process_recovery_done"
    job_id: int
    attempt: int
    generation: int
    rank: int
    duration_s: float


@_register
@dataclass(frozen=True, kw_only=True)
class InProcessRecoveryAbandoned(KnownEvent):
    """An in-process recovery given up for today's full restart, and why (a second fault
    while the group was being formed, a rank that could not re-join, the node lost, the
    deadline passed) or not tried (``generation`` 0: the fault does not allow it)."""

    kind = "in_process_recovery_abandoned"
    job_id: int
    attempt: int
    generation: int
    reason: str


# External schedulers (Slurm) -------------------------------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class ExternalScript(KnownEvent):
    """The batch script was written for the user to submit (a dry run)."""

    kind = "external_script"
    job_id: int
    path: str


@_register
@dataclass(frozen=True, kw_only=True)
class ExternalSubmitted(KnownEvent):
    kind = "external_submitted"
    job_id: int
    external_id: str


@_register
@dataclass(frozen=True, kw_only=True)
class ExternalError(KnownEvent):
    """A best-effort scheduler operation (submit, cancel, drain, ...) failed."""

    kind = "external_error"
    action: str
    error: str = ""
    job_id: int | None = None
    node: str | None = None


@_register
@dataclass(frozen=True, kw_only=True)
class JobRequeued(KnownEvent):
    """The job was requeued in Slurm: by trainpod (``exclude``: the nodes left out) or by
    Slurm itself (``by="slurm"``)."""

    kind = "job_requeued"
    job_id: int
    external_id: str = ""
    reason: str = ""
    exclude: tuple[str, ...] | None = field(default=None, metadata=_OMIT_NONE)
    by: str | None = field(default=None, metadata=_OMIT_NONE)


@_register
@dataclass(frozen=True, kw_only=True)
class ExternalReaped(KnownEvent):
    """A job that Slurm still ran after trainpod ended it was cancelled there."""

    kind = "external_reaped"
    job_id: int
    external_id: str = ""
    external_state: str = field(default="", metadata=_key("was"))


@_register
@dataclass(frozen=True, kw_only=True)
class ExternalReleased(KnownEvent):
    """The job's allocation was given back to Slurm."""

    kind = "external_released"
    job_id: int
    external_id: str = ""
    reason: str = ""


# Checkpoints (controller/checkpoints.py) -------------------------------------------------

Scope = Literal["node", "job"]


@_register
@dataclass(frozen=True, kw_only=True)
class CheckpointSaved(KnownEvent):
    """A step committed in the memory tier, once per job and step (node column: none)."""

    kind = "checkpoint_saved"
    job_id: int
    attempt: int | None
    at: float | None
    """By the agent's clock."""
    step: int
    tier: str
    scope: Scope = "node"
    stall_s: float | None
    """The longest save() stall of any rank."""
    bytes: int = 0
    by: str = ""
    """The node that reported it."""


@_register
@dataclass(frozen=True, kw_only=True)
class CheckpointCommitted(KnownEvent):
    """A step committed in a tier: the node column is None for a tier that holds the whole
    checkpoint (scope job: durable), else the node whose part it is."""

    kind = "checkpoint_committed"
    job_id: int
    attempt: int | None
    node: str | None
    at: float | None
    step: int
    tier: str
    scope: Scope = "node"
    bytes: int = 0
    seconds: float = 0.0
    since_save_s: float | None
    by: str | None = field(default=None, metadata=_OMIT_NONE)
    """Scope job only: the node that reported it."""
    wrote_manifest: bool | None = field(default=None, metadata=_OMIT_NONE)
    """Scope job only."""
    skipped: int | None = field(default=None, metadata=_OMIT_NONE)
    """Memory-tier steps this tier skipped since its previous commit (it was busy with an
    older one); absent when none."""


@_register
@dataclass(frozen=True, kw_only=True)
class CheckpointFailed(KnownEvent):
    kind = "checkpoint_failed"
    job_id: int
    attempt: int | None
    node: str
    at: float | None
    step: int
    tier: str
    scope: Scope = "node"
    reason: str = ""
    bytes: int = 0


@_register
@dataclass(frozen=True, kw_only=True)
class CheckpointTierFull(KnownEvent):
    """A tier (``/dev/shm`` first) was full or unwritable for a step on a node: the save went
    to ``to`` instead (None: no node-local tier took it, ``reason`` names them all), the
    partial files were removed, what the tier had committed stays (docs/decisions/0036)."""

    kind = "checkpoint_tier_full"
    job_id: int
    attempt: int | None
    node: str
    at: float | None
    step: int
    tier: str
    path: str = ""
    reason: str = ""
    """ENOSPC, EDQUOT, EROFS or EACCES, then what was seen."""
    needed_bytes: int = 0
    """What the node's part of the step needed."""
    free_bytes: int | None = None
    """Free on the tier's file system after the partial files were removed."""
    to: str | None = None


# Users and access (controller/access.py) ----------------------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class JobHeld(KnownEvent):
    """The job stays in the queue, never placed, until released (``trainpod hold``)."""

    kind = "job_held"
    job_id: int
    by: str


@_register
@dataclass(frozen=True, kw_only=True)
class JobReleased(KnownEvent):
    kind = "job_released"
    job_id: int
    by: str


@_register
@dataclass(frozen=True, kw_only=True)
class AccessDenied(KnownEvent):
    """A call was refused: who asked, to do what, and why (also answered as HTTP 403)."""

    kind = "access_denied"
    user: str
    action: str
    job_id: int | None = None
    node: str | None = None
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class AuthFailed(KnownEvent):
    """A call's bearer token was refused (HTTP 401): from which address, what it called, and
    why. Never the token. At most ``max_failures`` a window per address are recorded
    (:mod:`trainpod.api.throttle`); ``unrecorded`` counts the failures before this one that
    were not."""

    kind = "auth_failed"
    client: str
    method: str
    path: str
    reason: str
    unrecorded: int = 0


@_register
@dataclass(frozen=True, kw_only=True)
class AuthThrottled(KnownEvent):
    """A client address failed to authenticate too often: its calls are answered 429 for
    ``retry_after_s`` (one event per such run of failures, not one per failure)."""

    kind = "auth_throttled"
    client: str
    failures: int
    window_s: float
    retry_after_s: float


@_register
@dataclass(frozen=True, kw_only=True)
class TokenIssued(KnownEvent):
    kind = "token_issued"
    user: str
    token_id: str
    by: str


@_register
@dataclass(frozen=True, kw_only=True)
class TokensRevoked(KnownEvent):
    kind = "tokens_revoked"
    user: str
    token_ids: tuple[str, ...]
    by: str


# Interactive allocations (controller/allocations.py) -------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class AllocationReleased(KnownEvent):
    """The CLI of a ``trainpod alloc`` gave its allocation back (the shell exited, the
    terminal closed, the CLI was stopped); the job is cancelled after this."""

    kind = "allocation_released"
    job_id: int
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class AllocationExpired(KnownEvent):
    """An allocation ended by the controller: its CLI stopped renewing the lease (killed,
    its host gone), or its ``--time`` ran out."""

    kind = "allocation_expired"
    job_id: int
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class StepStarted(KnownEvent):
    """``trainpod run`` inside an allocation: a step's ranks on the allocation's nodes."""

    kind = "step_started"
    job_id: int
    attempt: int | None
    step: int
    nodes: tuple[str, ...] = ()
    procs_per_node: int = 1
    command: tuple[str, ...] = ()


@_register
@dataclass(frozen=True, kw_only=True)
class StepEnded(KnownEvent):
    kind = "step_ended"
    job_id: int
    attempt: int | None
    step: int
    exit_code: int


# -- reading ------------------------------------------------------------------------------
def parse(row: EventLike) -> Event:
    """The typed event of a row of the log (an ``EventRow``, an ``EventInfo``, ...).

    Never raises: an unknown kind, or a row without what its kind needs, is an
    :class:`UnknownEvent` carrying the raw data. See the module docstring for the rules."""
    data = row.data if isinstance(row.data, dict) else {}
    cls = EVENT_TYPES.get(row.kind)
    if cls is not None:
        values: dict[str, Any] = {}
        for f in _CODECS[cls]:
            raw = getattr(row, f.key) if f.column else data.get(f.key)
            value = BAD if raw is None else f.decode(raw)
            if value is not BAD:
                values[f.name] = value
            elif f.has_default:
                continue
            elif f.nullable:
                values[f.name] = None
            else:
                break  # the row lacks what this kind needs
        else:
            return cls(**values)
    return UnknownEvent(
        kind=str(row.kind), node=row.node, job_id=row.job_id, attempt=row.attempt, data=dict(data)
    )


def details(event: Event) -> dict[str, Any]:
    """The event's payload under its attribute names, the columns left out (an
    :class:`UnknownEvent`'s raw data): what a listing of the log shows."""
    if isinstance(event, UnknownEvent):
        return dict(event.data)
    return {f.name: getattr(event, f.name) for f in _CODECS[type(event)] if not f.column}


def recorded(row: StoredEventLike) -> Recorded:
    """:func:`parse`, keeping the row's id and time."""
    return Recorded(row.id, row.ts, parse(row))
