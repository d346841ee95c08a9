"""Goodput: where a job's wall clock went, from its record and its events only (never logs).

``compute_goodput`` is pure (the caller passes ``now``). It walks the job's phases in order
and gives each second of [submit, end] to at most one bucket, so they sum to the wall clock.
Anything estimated, missing or inconsistent is said in ``notes``; odd events never raise.
The buckets are defined in ``trainpod.telemetry``'s docstring.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from trainpod.model.events import (
    AttemptCreated,
    AttemptProgress,
    AttemptStateChanged,
    FaultClassified,
    FaultDetected,
    FirstBeacon,
    InProcessRecoveryDone,
    JobPreempted,
    RankStarted,
    RecoveryDecision,
    StoredEventLike,
    parse,
)
from trainpod.model.states import AttemptState, JobState

BUCKETS = (  # in display order
    "queued",
    "startup",
    "productive",
    "running_no_beacons",
    "checkpoint_stall",
    "recomputed",
    "in_process",
    "detection",
    "teardown",
    "restart",
    "waiting_for_spare",
    "preemption",
    "reload",
    "shutdown",
    "unaccounted",
)
KINDS = tuple(
    e.kind
    for e in (
        AttemptCreated,
        RankStarted,
        FirstBeacon,
        FaultDetected,
        FaultClassified,
        AttemptStateChanged,
        AttemptProgress,
        JobPreempted,
        RecoveryDecision,
    )
)
"""The kinds of event goodput reads: of a job that has an end time, its events of other kinds
change nothing (a reader may fetch only these; ``/metrics`` does)."""


class RankFacts(Protocol):
    @property
    def started_at(self) -> float | None: ...


class AttemptFacts(Protocol):
    """What goodput reads of an attempt's record (an ``AttemptInfo`` has it)."""

    @property
    def number(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def nodes(self) -> Sequence[str]: ...
    @property
    def created_at(self) -> float: ...
    @property
    def started_at(self) -> float | None: ...
    @property
    def ended_at(self) -> float | None: ...
    @property
    def cause(self) -> str: ...
    @property
    def ranks(self) -> Sequence[RankFacts]: ...


class JobFacts(Protocol):
    """What goodput reads of a job's record (a ``JobInfo`` has it)."""

    @property
    def id(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def submitted_at(self) -> float: ...
    @property
    def ended_at(self) -> float | None: ...
    @property
    def attempts(self) -> Sequence[AttemptFacts]: ...


_ATTEMPT_ENDED = frozenset(s.value for s in AttemptState if s.ended)
_JOB_ENDED = frozenset(s.value for s in JobState if s.ended)
_RETRY = {"restart", "wait"}
_EPS = 1e-3  # seconds of overlap or inversion worth a note (below: clock jitter)


@dataclass(frozen=True)
class FaultRecord:
    attempt: int
    fault: str
    fault_at: float
    detected_at: float
    reason: str = ""
    rank: int | None = None
    nodes: list[str] = field(default_factory=list)


@dataclass
class AttemptTimeline:
    """One attempt as the events tell it; ``replaced`` = nodes swapped out to create it."""

    number: int
    created_at: float | None = None
    first_rank_at: float | None = None
    first_beacon_at: float | None = None
    last_beacon_at: float | None = None
    ended_at: float | None = None
    state: str = "unknown"
    cause: str = ""
    fault: str | None = None
    fault_at: float | None = None
    detected_at: float | None = None
    first_step: int | None = None
    last_step: int | None = None
    nodes: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    recovery: str | None = None
    waiting_since: float | None = None
    step_time_s: float | None = None
    checkpoint_stall_s: float = 0.0
    last_checkpoint_step: int | None = None
    preempted_at: float | None = None  # its notice: job_preempted
    in_process: list[tuple[float, float]] = field(default_factory=list)
    """Its in-process recoveries (ADR 0026): fault → the replaced ranks running again."""


_A = AttemptTimeline
_F = FaultRecord


@dataclass(frozen=True)
class GoodputReport:
    job_id: int
    state: str
    submitted_at: float
    ended_at: float | None
    wall_s: float
    buckets: dict[str, float]
    goodput: float
    ettr: float
    lost_by_cause: dict[str, float]
    attempts: list[AttemptTimeline]
    faults: list[FaultRecord]
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _min(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


class _Sweep:
    """Gives each second between ``start`` and ``end`` to at most one bucket, in order."""

    def __init__(self, start: float, end: float, notes: list[str]) -> None:
        self.cursor, self.end, self.notes = start, end, notes
        self.b = dict.fromkeys(BUCKETS, 0.0)

    def span(self, what: str, a: float | None, b: float | None) -> float:
        if a is None or b is None:
            return 0.0
        if b < a - _EPS:
            self.notes.append(f"{what}: ends {a - b:.3f}s before it starts; counted as 0")
        elif self.cursor - a > _EPS and b > a:
            over = min(self.cursor, b) - a
            self.notes.append(f"{what}: overlaps the previous phase by {over:.3f}s; counted once")
        if b > self.end + _EPS:
            self.notes.append(f"{what}: runs {b - self.end:.3f}s past the end of the wall clock")
        lo, hi = max(a, self.cursor), min(b, self.end)
        if hi <= lo:
            return 0.0
        self.cursor = hi
        return hi - lo

    def add(self, bucket: str, a: float | None, b: float | None, label: str = "") -> None:
        self.b[bucket] += self.span(f"{label}{bucket}", a, b)


def _collect(
    job: JobFacts, evs: list[StoredEventLike], notes: list[str]
) -> tuple[list[_A], list[_F]]:
    atts: dict[int, AttemptTimeline] = {}
    faults: list[FaultRecord] = []
    replaced: dict[int, list[str]] = {}
    for row in evs:
        n, ts = row.attempt, row.ts
        if n is None:  # job-level (job_state, ...): the job record has what we need
            continue
        a = atts.setdefault(n, AttemptTimeline(n))
        match parse(row):
            case AttemptCreated() as e:
                a.created_at = _min(a.created_at, ts)
                a.nodes = list(e.nodes) or a.nodes
            case RankStarted() as e:
                a.first_rank_at = _min(
                    a.first_rank_at, ts if e.started_at is None else e.started_at
                )
            case FirstBeacon() as e:
                a.first_beacon_at = _min(a.first_beacon_at, ts if e.at is None else e.at)
                a.first_step = a.first_step if a.first_step is not None else e.step
            case FaultDetected() as e:
                fault_at = e.fault_at
                if fault_at is None:
                    notes.append(f"attempt {n}: fault without fault_at; used detection time")
                    fault_at = ts
                cause = e.cause or "unknown"
                faults.append(
                    f := FaultRecord(n, cause, fault_at, ts, e.reason, e.rank, list(e.nodes))
                )
                if a.fault is None or (a.fault == "straggler" and f.fault != "straggler"):
                    a.fault, a.fault_at, a.detected_at = f.fault, f.fault_at, f.detected_at
            case FaultClassified() as e if e.cause:  # what the fault turned out to be
                a.fault = e.cause
                faults[:] = [
                    replace(f, fault=e.cause, nodes=list(e.nodes) or f.nodes)
                    if f.attempt == n
                    else f
                    for f in faults
                ]
            case AttemptStateChanged() as e if a.state not in _ATTEMPT_ENDED:
                a.state, a.cause = e.new.value, e.cause or a.cause
                a.ended_at = ts if e.new.ended else None
            case AttemptProgress() as e:
                # A summary without a first step keeps the one the first beacon gave.
                a.first_step = a.first_step if e.first_step is None else e.first_step
                a.last_step = e.last_step
                a.first_beacon_at = _min(a.first_beacon_at, e.first_beacon_at)
                a.last_beacon_at = e.last_beacon_at
                step_time = e.step_time_s  # a median; 0 or less is no answer
                a.step_time_s = step_time if step_time is not None and step_time > 0 else None
                a.checkpoint_stall_s = max(0.0, e.checkpoint_stall_s)
                a.last_checkpoint_step = e.last_checkpoint_step
            case JobPreempted():
                a.preempted_at = _min(a.preempted_at, ts)
            case InProcessRecoveryDone() as e:
                a.in_process.append((ts - max(0.0, e.duration_s), ts))
            case RecoveryDecision() as e:
                a.recovery = e.action
                a.waiting_since = _min(a.waiting_since, ts if e.action == "wait" else None)
                replaced[n] = list(e.replaced or {}) or replaced.get(n, [])
    for info in job.attempts:  # the job record fills in what the events lack
        a = atts.setdefault(info.number, AttemptTimeline(info.number))
        starts = [r.started_at for r in info.ranks if r.started_at is not None]
        a.first_rank_at = _min(a.first_rank_at, min(starts, default=info.started_at))
        a.created_at = info.created_at if a.created_at is None else a.created_at
        a.nodes, a.cause = a.nodes or list(info.nodes), a.cause or info.cause
        if a.state not in _ATTEMPT_ENDED:
            a.state, a.ended_at = info.state, info.ended_at
    out = [atts[n] for n in sorted(atts)]
    for prev, a in itertools.pairwise(out):
        a.replaced = replaced.get(prev.number) or sorted(set(prev.nodes) - set(a.nodes))
    return out, faults


def _between(sw: _Sweep, prev: _A, created: float | None, first: float | None) -> None:
    """Failed attempt's end → the next one's first rank: restart, maybe waiting for a spare;
    after a preemption, the wait in the queue is the preemption's."""
    label, end, wait = f"attempt {prev.number}→{prev.number + 1}: ", prev.ended_at, None
    if prev.preempted_at is not None:
        sw.add("preemption", end, first, label)
        return
    if prev.waiting_since is not None:  # the decision may come before the teardown ends
        wait = prev.waiting_since if end is None else max(prev.waiting_since, end)
        sw.add("restart", end, wait, label)
        sw.add("waiting_for_spare", wait, created, label)
        end = created
    sw.add("restart", end, first, label)


def _beaconed(sw: _Sweep, a: _A, last: float | None, earlier: list[_A]) -> None:
    """First → last beacon: productive, less recomputed steps and checkpoint stalls."""
    label, prev = f"attempt {a.number}: ", earlier[-1] if earlier else None
    hwm = max((x.last_step for x in earlier if x.last_step is not None), default=None)
    span = sw.span(f"{label}beaconed time", a.first_beacon_at, last)
    redo = 0.0
    if hwm is not None and a.first_step is not None and a.first_step <= hwm:
        top = hwm if a.last_step is None else min(hwm, a.last_step)
        steps = max(0, top - a.first_step + 1)
        step_time = (prev.step_time_s if prev else None) or a.step_time_s
        if step_time is None:
            sw.notes.append(f"{label}{steps} steps redone, but no step time to size them")
        redo = steps * (step_time or 0.0)
    stall = a.checkpoint_stall_s
    kept = _in_process(sw, a, a.first_beacon_at, last, span)
    span -= kept
    if (over := redo + stall - span) > _EPS:
        sw.notes.append(f"{label}recomputed + checkpoint stall exceed its beacons by {over:.3f}s")
    redo = min(redo, span)
    stall = min(stall, span - redo)
    # Steps redone after a preemption are the work it lost (notice after the last save).
    sw.b["preemption" if prev is not None and prev.preempted_at is not None else "recomputed"] += (
        redo
    )
    sw.b["checkpoint_stall"] += stall
    sw.b["productive"] += span - redo - stall


def _in_process(sw: _Sweep, a: _A, lo: float | None, hi: float | None, span: float) -> float:
    """Move the time ``a``'s in-process recoveries took within [lo, hi] (at most ``span``)
    to ``in_process``; the seconds moved. Counted from the fault to the replaced ranks
    running again: the healthy ranks' re-join after that and the one step a recovery may
    redo stay in the surrounding bucket."""
    if lo is None or hi is None or not a.in_process:
        return 0.0
    took = sum(max(0.0, min(b, hi) - max(f, lo)) for f, b in a.in_process)
    took = min(took, span)
    sw.b["in_process"] += took
    return took


def _attempt(sw: _Sweep, a: _A, earlier: list[_A], final: bool, ended: bool) -> None:
    label = f"attempt {a.number}: "
    if not earlier:
        sw.add("queued", sw.cursor, a.created_at)
        first = a.first_rank_at if a.first_beacon_at is None else a.first_beacon_at
        sw.add("startup", a.created_at, first, label)
    else:
        _between(sw, earlier[-1], a.created_at, a.first_rank_at)
        sw.add("reload", a.first_rank_at, a.first_beacon_at, label)
    active = a.state not in _ATTEMPT_ENDED
    end = sw.end if a.ended_at is None and final else a.ended_at
    fault_at = a.fault_at if a.state == "failed" or (active and a.state == "stopping") else None
    notice = a.preempted_at if fault_at is None else None
    upto = fault_at if fault_at is not None else notice if notice is not None else end
    last = a.last_beacon_at
    if a.first_beacon_at is None:
        sw.notes.append(f"{label}sent no progress beacons: its run time is running_no_beacons")
        span = sw.span(f"{label}running_no_beacons", a.first_rank_at, upto)
        sw.b["running_no_beacons"] += span - _in_process(sw, a, a.first_rank_at, upto, span)
    elif last is None and active:
        sw.notes.append(f"{label}still running: productive is estimated from its first beacon")
        _beaconed(sw, a, upto, earlier)
    elif last is None:
        sw.notes.append(f"{label}no attempt_progress; time after its first beacon is unsplit")
        sw.add("running_no_beacons", a.first_beacon_at, upto, label)
    else:
        _beaconed(sw, a, last, earlier)
        sw.add("recomputed", last, fault_at, label)
    if notice is not None:
        sw.add("preemption", sw.cursor, end, label)  # last beacon (or notice) → stopped
    elif fault_at is not None:
        sw.add("detection", fault_at, a.detected_at, label)
        sw.add("teardown", a.detected_at, end, label)
    elif a.state == "failed":
        sw.notes.append(f"{label}failed without a fault_detected event; its end is unaccounted")
    if final and ended:
        clean = last is not None and fault_at is None and a.state != "failed"
        sw.add("shutdown", last if clean else end, sw.end, label)


def compute_goodput(job: JobFacts, events: Sequence[StoredEventLike], now: float) -> GoodputReport:
    """Split ``job``'s wall clock (submit → end, or ``now`` while it runs) into BUCKETS."""
    notes: list[str] = []
    mine = sorted((e for e in events if e.job_id == job.id), key=lambda e: (e.ts, e.id))
    attempts, faults = _collect(job, mine, notes)
    start, job_ended = job.submitted_at, job.state in _JOB_ENDED
    end = job.ended_at if job_ended else now
    if end is None:
        end = max([start] + [e.ts for e in mine])
        notes.append(f"job {job.state} but has no end time; used its last event")
    if end < start:
        notes.append(f"job ends {start - end:.3f}s before it was submitted; wall clock is 0")
        end = start
    sw = _Sweep(start, end, notes)
    last = attempts[-1] if attempts else None  # failed, and the job recovers (or did): restart
    pending = last is not None and last.ended_at is not None and last.state == "failed"
    pending = pending and (not job_ended or (last is not None and last.recovery in _RETRY))
    for i, a in enumerate(attempts):
        _attempt(sw, a, attempts[:i], a is last, job_ended and not pending)
    if last is None:
        sw.add("queued", start, end)
    elif pending:
        _between(sw, last, end, end)
    wall, b = end - start, sw.b
    b["unaccounted"] = max(0.0, wall - sum(b.values()))
    if b["unaccounted"] > 0.5:
        notes.append(f"{b['unaccounted']:.3f}s that no event explains is unaccounted")
    lost = [(k, v) for k, v in b.items() if k != "productive" and v > 0]
    goodput = min(1.0, b["productive"] / wall) if wall > 0 else 0.0
    ettr = min(1.0, b["productive"] / (wall - b["queued"])) if wall > b["queued"] else 0.0
    return GoodputReport(
        job.id,
        job.state,
        start,
        end if job_ended else None,
        wall,
        dict(b),
        goodput,
        ettr,
        dict(sorted(lost, key=lambda kv: -kv[1])),
        attempts,
        faults,
        notes,
    )
