"""Applying decisions: the recovery ladder's and the scheduler's, in one place.

The decisions come from pure functions: :func:`trainpod.controller.judge.judge` (what an
attempt's ranks mean), :func:`trainpod.controller.policy.decide` (the recovery ladder) and
the scheduler's ``plan`` (:mod:`trainpod.scheduler`). :class:`Executor` applies them to the
store. Every step is an event: ``fault_detected``, ``recovery_decision``, node state
changes, ``attempt_created`` for a placement or a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from signal import SIGABRT
from typing import Any, cast

from trainpod.controller import judge as judging
from trainpod.controller import progress
from trainpod.controller.books import BeaconBook
from trainpod.controller.config import ControllerConfig
from trainpod.controller.external import Scheduling
from trainpod.controller.policy import (
    Decision,
    Fail,
    Fault,
    FaultKind,
    JobView,
    NodeView,
    Restart,
    Wait,
    crash_signature,
    decide,
    teardown_abort,
)
from trainpod.controller.rung import InProcessRung
from trainpod.controller.transitions import HEALTHY_NODE_STATES, HELD_NODE_STATES, Transitions
from trainpod.model.events import (
    AttemptProgress,
    FaultClassified,
    FaultDetected,
    JobFirstStart,
    JobPreempted,
    RankExited,
    RecoveryDecision,
)
from trainpod.model.failures import Classified, Failure, RepairState
from trainpod.model.states import AttemptState, JobState, NodeState, RankState
from trainpod.scheduler.base import Hold, Place, Preempt, SchedulerDecision
from trainpod.store.repo import Store
from trainpod.store.rows import AttemptRow, JobRow, NodeRow, RankRow

log = logging.getLogger(__name__)

_COUNTING = {FaultKind.CRASH.value, FaultKind.HANG.value}
CAUSE_PREEMPTED = judging.CAUSE_PREEMPTED
_FAULTY = HELD_NODE_STATES | {NodeState.SUSPECT}


@dataclass
class Executor:
    store: Store
    cfg: ControllerConfig
    tx: Transitions
    scheduling: Scheduling
    beacons: BeaconBook
    holds: dict[int, Hold] = field(default_factory=dict, init=False)
    """Why each queued job waits, as the scheduler said on its last pass."""
    rung: InProcessRung = field(init=False)
    """The in-process rung (ADR 0026), applied before the judge sees a rank's failure."""
    teardown_waits: set[int] = field(default_factory=set, init=False)
    """Attempts whose judge waits on the other ranks of a teardown abort (ADR 0044)."""
    _aborts: dict[tuple[int, int], bool] = field(default_factory=dict, init=False)
    """(attempt, rank) -> whether that rank's SIGABRT was a teardown abort."""

    def __post_init__(self) -> None:
        self.rung = InProcessRung(self.store, self.cfg, self.tx, self.beacons, self.free_nodes)

    def free_nodes(self, job_id: int) -> list[str]:
        """Where a lost node's ranks may go in process: free healthy nodes of the job's
        partition, hot spares first (as the ladder's replacement, ADR 0035)."""
        spec = self.tx.spec(self.tx.job(job_id))
        groups = self.cfg.partitions.get(spec.partition or self.cfg.default_partition, [])
        pool = [v for v in self.node_views(job_id) if v.free and v.healthy and v.group in groups]
        return [v.name for v in sorted(pool, key=lambda v: not v.spare)]

    # -- the scheduler's decisions ------------------------------------------------------------
    def schedule(self, decisions: Iterable[SchedulerDecision], now: float) -> bool:
        """Apply one scheduling pass; True if anything changed in the store."""
        changed = False
        holds: dict[int, Hold] = {}
        for d in decisions:
            if isinstance(d, Hold):
                holds[d.job_id] = d
            elif isinstance(d, Place):
                job = self.tx.job(d.job_id)
                self.tx.start_attempt(job, list(d.nodes), now, d.restart_reason, d.lent_by)
                changed = True
            else:
                changed |= self.preempt(d, now)
        self.holds = holds
        return changed

    def preempt(self, d: Preempt, now: float) -> bool:
        """Stop a running job so that it can be queued again; its ranks get ``grace_s``."""
        attempt = self.tx.active_attempt(d.job_id)
        if attempt is None or attempt.state is AttemptState.STOPPING:
            return False
        self.store.append(
            now, JobPreempted(job_id=d.job_id, attempt=attempt.number, reason=d.reason)
        )
        failure = Failure(reason=d.reason, grace_s=d.grace_s, nodes=tuple(attempt.nodes))
        self.stop_attempt(attempt, CAUSE_PREEMPTED, failure, now)
        return True

    # -- attempts -----------------------------------------------------------------------------
    def reconcile(self, attempt_id: int, now: float, tails: dict[int, str]) -> None:
        """Judge an attempt's ranks; move it (and its job) on if they say so."""
        attempt = self.store.attempt(attempt_id)
        if attempt is None:
            return
        job = self.tx.job(attempt.job_id)
        ranks = self.store.ranks(attempt.id)
        recovering: frozenset[int] = frozenset()
        if job.spec.get("recovery") == "in-process":  # the rung's (ADR 0026); cheap otherwise
            left = self._restarts_left(job)
            recovering = self.rung.recovering(attempt, ranks, left, now, tails)
            attempt = self.store.attempt(attempt_id) or attempt
        teardown = self._teardown_aborts(attempt, ranks, tails)
        verdict = judging.judge(
            attempt,
            ranks,
            cancel_requested=job.cancel_requested,
            tails=tails,
            recovering=recovering,
            teardown=teardown,
            now=now,
        )
        if verdict is None:
            if teardown:
                self.teardown_waits.add(attempt.id)
            return
        self.teardown_waits.discard(attempt.id)
        if verdict.state.ended:
            for r in ranks:
                self._aborts.pop((attempt.id, r.rank), None)
        fields: dict[str, Any] = {}
        if verdict.state is AttemptState.RUNNING:
            fields["started_at"] = now
        if verdict.cause:
            fields["cause"] = verdict.cause
        if not verdict.failure.empty:
            fields["failure"] = verdict.failure.to_json()
        self.tx.set_attempt(attempt, verdict.state, now, **fields)
        ended = self.store.attempt(attempt.id)
        assert ended is not None
        self._after_attempt(self.tx.job(job.id), ended, verdict, now)

    def teardown_deadlines(self, now: float) -> None:
        """Judge again the attempts that wait on a teardown abort: past the wait it fails."""
        for attempt_id in sorted(self.teardown_waits):
            self.teardown_waits.discard(attempt_id)
            self.reconcile(attempt_id, now, {})

    def _teardown_aborts(
        self, attempt: AttemptRow, ranks: list[RankRow], tails: dict[int, str]
    ) -> frozenset[int]:
        """The ranks of ``attempt`` that aborted in their teardown (:func:`teardown_abort`),
        from this report's tails or, for a rank reported earlier, its ``rank_exited`` event."""
        found: set[int] = set()
        for r in ranks:
            if r.state is not RankState.EXITED or r.signal != SIGABRT:
                continue
            key = (attempt.id, r.rank)
            if key not in self._aborts:
                tail = tails.get(r.rank)
                if tail is None:
                    tail = self._exit_tail(attempt, r.rank)
                self._aborts[key] = teardown_abort(r.signal, tail)
            if self._aborts[key]:
                found.add(r.rank)
        return frozenset(found)

    def _exit_tail(self, attempt: AttemptRow, rank: int) -> str:
        for e in reversed(self.store.typed_events(job_id=attempt.job_id)):
            ev = e.event
            if isinstance(ev, RankExited) and ev.attempt == attempt.number and ev.rank == rank:
                return ev.log_tail or ""
        return ""

    def hang_in_process(
        self,
        attempt: AttemptRow,
        beacons: progress.Book,
        hung_rank: int | None,
        reason: str,
        fault_at: float,
        now: float,
    ) -> bool:
        """A hung attempt of an in-process job: True while the rung handles it (the silent
        ranks replaced in process, or waiting for the others to say they lost their group);
        False: stop it as any hung attempt."""
        job = self.tx.job(attempt.job_id)
        if job.cancel_requested:
            return False
        left = self._restarts_left(job)
        return self.rung.hung(attempt, beacons, hung_rank, reason, fault_at, left, now)

    def recovery_deadlines(self, now: float) -> None:
        """In-process recoveries past their deadline fall back to a full restart."""
        for attempt, failure in self.rung.overdue(now):
            self.stop_attempt(attempt, judging.CAUSE_RANK_FAILED, failure, now)

    def _restarts_left(self, job: JobRow) -> int:
        """Restarts ``job`` may still use: in-process recoveries count as restarts."""
        spec = self.tx.spec(job)
        most = spec.max_restarts if spec.max_restarts is not None else self.cfg.max_restarts
        attempts = self.store.attempts(job.id)
        used = sum(self.fault_of(a).kind.value in _COUNTING for a in attempts if a.state.ended)
        return most - used - sum(a.in_process.generation for a in attempts)

    def stop_attempt(self, attempt: AttemptRow, cause: str, failure: Failure, now: float) -> None:
        """Begin tearing an attempt down because of something seen outside its ranks (a
        fault, a preemption), and record the fault now."""
        if attempt.state.ended or attempt.state is AttemptState.STOPPING:
            return
        if attempt.in_process.pending and cause != judging.CAUSE_RANK_FAILED:
            self.rung.abandon(attempt, f"{cause}: {failure.reason or 'the attempt stopped'}", now)
        self.tx.set_attempt(
            attempt, AttemptState.STOPPING, now, cause=cause, failure=failure.to_json()
        )
        job = self.tx.job(attempt.job_id)
        if job.state in (JobState.STARTING, JobState.RUNNING):
            reason = cause if failure.reason is None else failure.reason
            self.tx.set_job(job, JobState.STOPPING, now, reason=reason)
        self.reconcile(attempt.id, now, {})
        stopped = self.store.attempt(attempt.id)
        if stopped is not None and stopped.state is AttemptState.STOPPING:
            self._note_fault(stopped, now)  # ended at once: _after_attempt noted it

    def _after_attempt(
        self, job: JobRow, attempt: AttemptRow, verdict: judging.Verdict, now: float
    ) -> None:
        state = verdict.state
        if state is AttemptState.RUNNING:
            self.tx.set_job(job, JobState.RUNNING, now, started_at=job.started_at or now)
            if job.started_at is None:
                self.store.append(now, JobFirstStart(job_id=job.id))
            return
        if state is AttemptState.STOPPING:
            self._note_fault(attempt, now)
            if not job.state.ended and job.state is not JobState.STOPPING:
                cancelling = verdict.cause == judging.CAUSE_CANCEL
                why = "cancelling" if cancelling else _reason(verdict.failure)
                self.tx.set_job(job, JobState.STOPPING, now, reason=why)
            return
        if not state.ended:
            return
        self._log_progress(attempt, now)
        if state is AttemptState.SUCCEEDED:
            self.tx.release_all(job.id, now)
            self.tx.set_job(job, JobState.COMPLETED, now, reason=verdict.note)
        elif state is AttemptState.CANCELLED:
            self.tx.release_all(job.id, now)
            self.tx.set_job(job, JobState.CANCELLED, now, reason="cancelled by request")
        elif attempt.cause == CAUSE_PREEMPTED and not job.cancel_requested:
            self._requeue_preempted(job, attempt, now)
        elif attempt.cause == judging.CAUSE_TIME_LIMIT:
            self.tx.release_all(job.id, now)
            reason = attempt.failure.reason or "time limit reached"
            self.tx.set_job(self.tx.job(job.id), JobState.FAILED, now, reason=reason)
        else:
            if not verdict.failure.empty and not attempt.failure.noted:
                self._note_fault(attempt, now)
            self._recover(self.tx.job(job.id), attempt, now)

    def _requeue_preempted(self, job: JobRow, attempt: AttemptRow, now: float) -> None:
        """The preempted attempt has ended: the job waits in the queue as ``preempted``
        (no fault, no restart used) and resumes from its newest checkpoint when placed."""
        reason = f"preempted: {attempt.failure.reason or ''}"
        self.tx.release_all(job.id, now)
        self.tx.set_job(job, JobState.PREEMPTED, now, reason=reason)

    def _note_fault(self, attempt: AttemptRow, now: float) -> None:
        """Record ``fault_detected`` once per attempt, with when the fault really happened."""
        failure = attempt.failure
        skip = (
            judging.CAUSE_CANCEL,
            CAUSE_PREEMPTED,
            judging.CAUSE_TIME_LIMIT,
            judging.CAUSE_LEFT_IDLE,  # no fault: its work was done
        )
        if failure.empty or failure.noted or attempt.cause in skip:
            return
        fault_at = failure.fault_at
        if fault_at is None and failure.rank is not None:
            rank = next((r for r in self.store.ranks(attempt.id) if r.rank == failure.rank), None)
            fault_at = rank.ended_at if rank and rank.ended_at else now
            if failure.lost:
                node = self.store.node(failure.node or "")
                fault_at = node.last_heartbeat if node and node.last_heartbeat else now
        failure = replace(failure, noted=True, fault_at=fault_at or now)
        self.store.update_attempt(attempt.id, failure=failure.to_json())
        self.store.append(
            now,
            FaultDetected(
                job_id=attempt.job_id,
                attempt=attempt.number,
                node=failure.node,
                cause=attempt.cause,
                fault_at=failure.fault_at,
                reason=failure.reason or judging.describe_failure(failure),
                rank=failure.rank,
                nodes=_fault_nodes(failure),
            ),
        )

    def _log_progress(self, attempt: AttemptRow, now: float) -> None:
        summary = progress.summarise(self.beacons.forget(attempt.id))
        if summary:
            self.store.append(
                now,
                AttemptProgress(
                    job_id=attempt.job_id,
                    attempt=attempt.number,
                    first_step=summary["first_step"],
                    last_step=summary["last_step"],
                    first_beacon_at=summary["first_beacon_at"],
                    last_beacon_at=summary["last_beacon_at"],
                    step_time_s=summary["step_time_s"],
                    steps=summary["steps"],
                    last_checkpoint_step=summary["last_checkpoint_step"],
                    checkpoint_stall_s=summary["checkpoint_stall_s"],
                    ranks=summary["ranks"],
                ),
            )

    # -- deciding -------------------------------------------------------------------------
    def fault_of(self, attempt: AttemptRow) -> Fault:
        f = attempt.failure
        known = f.classified
        if known is not None:  # decided when the attempt ended; node states have moved on since
            return Fault(FaultKind(known.kind), known.reason, known.nodes, known.signature)
        try:
            kind = FaultKind(attempt.cause)
        except ValueError:
            kind = FaultKind.CRASH
        nodes = f.nodes or ((f.node,) if f.node else ())
        reason = f.reason or judging.describe_failure(f) or kind.value
        if kind is FaultKind.CRASH:
            # A rank that dies with its hardware, or whose peer's node died (Gloo/NCCL fail
            # at once with "connection closed"), is a node fault, not the job's: look at
            # every node of the attempt, not only the one whose rank exited first.
            held = [
                (n, row)
                for n in attempt.nodes
                if (row := self.store.node(n))
                and row.state in HELD_NODE_STATES | {NodeState.SUSPECT}
            ]
            if held:
                name, row = held[0]
                lost = row.state is NodeState.SUSPECT  # silent: quarantined in this same step
                default = FaultKind.NODE_LOST if lost else FaultKind.GPU_FAULT
                try:
                    node_kind = FaultKind(row.repair.kind or default.value)
                except ValueError:
                    node_kind = default
                return Fault(
                    node_kind,
                    f"{reason}; {name} failed at the same time: {row.reason}",
                    tuple(n for n, _ in held),
                )
            sig = crash_signature(f.exit_code, f.signal, f.log_tail or "")
            return Fault(kind, reason, nodes, sig)
        return Fault(kind, reason, nodes)

    def node_views(self, job_id: int | None = None) -> list[NodeView]:
        """The nodes recovery may choose from (for ``job_id``: the ones the scheduling
        strategy allows it, e.g. on Slurm only its own allocation)."""
        rows = self.store.nodes()
        if job_id is not None:
            rows = self.scheduling.recovery_pool(job_id, rows)
        return [
            NodeView(
                name=n.name,
                group=n.group,
                spare=n.spare,
                healthy=n.state in HEALTHY_NODE_STATES and not n.drained,
                free=n.state is NodeState.IDLE
                and not n.drained
                and n.job_id is None
                and n.role == "compute",
            )
            for n in sorted(rows, key=self.tx.node_order)
        ]

    def _recover(self, job: JobRow, attempt: AttemptRow, now: float) -> None:
        spec = self.tx.spec(job)
        attempts = self.store.attempts(job.id)
        earlier = [a for a in attempts if a.number < attempt.number]
        part = spec.partition or self.cfg.default_partition
        view = JobView(
            id=job.id,
            auto_resume=spec.auto_resume,
            max_restarts=spec.max_restarts
            if spec.max_restarts is not None
            else self.cfg.max_restarts,
            restarts_used=sum(self.fault_of(a).kind.value in _COUNTING for a in earlier)
            + sum(a.in_process.generation for a in attempts),
            node_restarts_used=_trailing(self.fault_of(a).kind.node_fault for a in earlier),
            nodes=spec.nodes,
            min_nodes=spec.min_nodes,
            groups=frozenset(self.cfg.partitions.get(part, [])),
            attempt_nodes=tuple(attempt.nodes),
            previous=self.fault_of(earlier[-1]) if earlier else None,
        )
        fault = self.fault_of(attempt)
        current = self.store.attempt(attempt.id)
        if current is not None and not _has_classified(current.failure):
            classified = Classified(fault.kind.value, fault.reason, fault.nodes, fault.signature)
            self.store.update_attempt(
                attempt.id, failure=replace(current.failure, classified=classified).to_json()
            )
            if fault.kind.value != attempt.cause:
                # What looked like one thing when detected turned out another once torn down
                # (a peer's crash caused by a node that died): say so, the log stays true.
                self.store.append(
                    now,
                    FaultClassified(
                        job_id=job.id,
                        attempt=attempt.number,
                        node=fault.nodes[0] if fault.nodes else None,
                        cause=fault.kind.value,
                        previous_cause=attempt.cause,
                        nodes=tuple(fault.nodes),
                        reason=fault.reason,
                    ),
                )
        decision = decide(view, fault, self.node_views(job.id))
        if job.cancel_requested and not isinstance(decision, Fail):
            # Cancelled while its fault was being torn down: never restart it.
            self.tx.release_all(job.id, now)
            self.tx.set_job(job, JobState.CANCELLED, now, reason="cancelled by request")
            self.tx.wake.bump()
            return
        self.execute(job, attempt, fault, decision, now)

    def execute(
        self, job: JobRow, attempt: AttemptRow, fault: Fault, decision: Decision, now: float
    ) -> None:
        """Apply a recovery decision for ``job``, whose ``attempt`` ended with ``fault``."""
        held = self.tx.held_nodes(job.id)
        if isinstance(decision, Wait):
            bad = sorted(fault.nodes) or sorted(set(attempt.nodes) - set(decision.keep))
            if self.scheduling.requeue(job, attempt, bad, now) is not None:
                pass  # the external scheduler runs the job again elsewhere
            elif job.state is JobState.RECOVERING and job.reason == decision.reason:
                return  # nothing new: still waiting for the same thing
            else:
                self._decision_event(job, attempt, "wait", decision.reason, decision.keep, now)
                self.tx.release_nodes(job.id, [n for n in held if n not in decision.keep], now)
                self.tx.set_job(job, JobState.RECOVERING, now, reason=decision.reason)
        elif isinstance(decision, Fail):
            self._decision_event(job, attempt, "fail", decision.reason, [], now)
            self.tx.release_nodes(job.id, held, now)
            tail = (attempt.failure.log_tail or "").strip()
            reason = f"{decision.reason}\n{tail}" if tail else decision.reason
            self.tx.set_job(job, JobState.FAILED, now, reason=reason)
        else:
            assert isinstance(decision, Restart)
            self._decision_event(
                job,
                attempt,
                "restart",
                decision.reason,
                decision.nodes,
                now,
                replaced=decision.replaced,
                counts=decision.counts,
                shrunk=decision.shrunk,
            )
            self.tx.release_nodes(job.id, [n for n in held if n not in decision.nodes], now)
            if job.state is not JobState.RECOVERING:
                self.tx.set_job(job, JobState.RECOVERING, now, reason=decision.reason)
            self.tx.start_attempt(
                self.tx.job(job.id),
                list(decision.nodes),
                now,
                restart_reason=f"{fault.kind.value}: {fault.reason}",
            )
        self.tx.wake.bump()

    def _decision_event(
        self,
        job: JobRow,
        attempt: AttemptRow,
        action: str,
        reason: str,
        nodes: Iterable[str],
        now: float,
        *,
        replaced: dict[str, str] | None = None,
        counts: bool | None = None,
        shrunk: bool | None = None,
    ) -> None:
        """Record a ``recovery_decision``; ``replaced``, ``counts`` and ``shrunk`` come with a
        restart only (left out of the event otherwise)."""
        self.store.append(
            now,
            RecoveryDecision(
                job_id=job.id,
                attempt=attempt.number,
                action=action,
                reason=reason,
                nodes=tuple(nodes),
                replaced=replaced,
                counts=counts,
                shrunk=shrunk,
            ),
        )

    def retry_waiting(self, now: float) -> None:
        """Jobs waiting for a spare: decide again, since nodes may have come back."""
        for job in self.store.jobs([JobState.RECOVERING]):
            attempts = self.store.attempts(job.id)
            if attempts and attempts[-1].state is AttemptState.FAILED:
                self._recover(job, attempts[-1], now)

    # -- quarantine ---------------------------------------------------------------------------
    def quarantine(
        self,
        node: NodeRow,
        reason: str,
        kind: FaultKind,
        now: float,
        *,
        repair: bool,
        fault_at: float | None = None,
    ) -> None:
        """Take a node out of service; stop the attempt it runs; optionally repair it."""
        if node.state in HELD_NODE_STATES:
            return
        request = RepairState(requested=repair, kind=kind.value, since=now)
        self.tx.set_node(node, NodeState.QUARANTINED, now, reason=reason, repair=request.to_json())
        self.scheduling.drain(node.name, reason, now)
        if node.job_id is None:
            return
        attempt = self.tx.active_attempt(node.job_id)
        if attempt is not None and node.name in attempt.nodes:
            if self._move_in_process(attempt, node.name, reason, now):
                return
            failure = Failure(
                reason=f"{node.name}: {reason}",
                nodes=(node.name,),
                node=node.name,
                fault_at=fault_at or now,
            )
            self.stop_attempt(attempt, kind.value, failure, now)

    def _move_in_process(self, attempt: AttemptRow, node: str, reason: str, now: float) -> bool:
        """An in-process job's ranks on a node just taken out of service, while its agent
        lives, start on a free node in the same attempt (ADR 0035), as a lost node's do:
        they are lost here (the agent, no longer part of the attempt, is ordered to kill
        them), and the rung moves them. True if so; False: the attempt stops as before."""
        job = self.tx.job(attempt.job_id)
        if not self.rung.would_move(attempt, node, self._restarts_left(job), now):
            return False
        for r in self.store.ranks(attempt.id):
            if r.node == node and not r.state.ended:
                self.tx.lose_rank(attempt, r.rank, node, now, f"node taken out: {reason}")
        self.reconcile(attempt.id, now, {})
        return True


def _trailing(flags: Iterable[bool]) -> int:
    """How many of the last ``flags`` are true in a row (node faults since the last other)."""
    run = 0
    for flag in flags:
        run = run + 1 if flag else 0
    return run


def _fault_nodes(failure: Failure) -> tuple[str, ...]:
    """The nodes ``fault_detected`` names: the record's ``nodes``, else its one ``node``."""
    if failure.nodes is not None:
        return failure.nodes
    return cast(tuple[str, ...], (failure.node,))  # a rank's record: its node is always known


def _has_classified(failure: Failure) -> bool:
    """Recovery has classified this fault already (a ``classified`` key, even one this
    version cannot read, counts: it is never overwritten)."""
    known = failure.classified is not None or "classified" in failure.nulls
    return known or "classified" in failure.extra


def _reason(failure: Failure) -> str:
    text = failure.reason or judging.describe_failure(failure)
    tail = (failure.log_tail or "").strip()
    return f"{text}\n{tail}" if tail else str(text)
