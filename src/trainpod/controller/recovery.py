"""Executing the recovery ladder: faults, quarantine, restarts, spares and node repair.

The decisions come from :mod:`trainpod.controller.policy` (pure); this mixin applies them to
the store. Every step is an event: ``fault_detected``, ``recovery_decision``, node state
changes, ``attempt_created`` for the restart.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from trainpod.api.models import Heartbeat, NodeAction
from trainpod.controller import judge as judging
from trainpod.controller import progress
from trainpod.controller.base import HEALTHY_NODE_STATES
from trainpod.controller.external import ExternalMixin
from trainpod.controller.nodes import lifecycle_failure
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
)
from trainpod.controller.states import AttemptState, JobState, NodeState
from trainpod.errors import Conflict
from trainpod.store.rows import AttemptRow, JobRow, NodeRow

log = logging.getLogger(__name__)

_COUNTING = {FaultKind.CRASH.value, FaultKind.HANG.value}
_HELD = {NodeState.QUARANTINED, NodeState.REPAIRING, NodeState.RETIRED}
REPAIR_SLACK_S = 120.0  # on top of the deep check's own timeout


class RecoveryMixin(ExternalMixin):
    #: Replaces a node like a new instance (fresh scratch, lifecycle scripts, new agent).
    #: Set by the daemon from the backend; None where nodes cannot be replaced.
    repairer: Callable[[str], None] | None = None

    # -- attempts end ---------------------------------------------------------------------
    def _after_attempt(
        self, job: JobRow, attempt: AttemptRow, verdict: judging.Verdict, now: float
    ) -> None:
        state = verdict.state
        if state is AttemptState.RUNNING:
            self._set_job(job, JobState.RUNNING, now, started_at=job.started_at or now)
            if job.started_at is None:
                self.store.add_event(now, "job_first_start", job_id=job.id)
            return
        if state is AttemptState.STOPPING:
            self._note_fault(attempt, now)
            if not job.state.ended and job.state is not JobState.STOPPING:
                cancelling = verdict.cause == judging.CAUSE_CANCEL
                why = "cancelling" if cancelling else _reason(verdict.failure)
                self._set_job(job, JobState.STOPPING, now, reason=why)
            return
        if not state.ended:
            return
        self._log_progress(attempt, now)
        if state is AttemptState.SUCCEEDED:
            self._release_nodes(job.id, self._held_nodes(job.id), now)
            self._set_job(job, JobState.COMPLETED, now, reason="")
        elif state is AttemptState.CANCELLED:
            self._release_nodes(job.id, self._held_nodes(job.id), now)
            self._set_job(job, JobState.CANCELLED, now, reason="cancelled by request")
        else:
            if verdict.failure and not attempt.failure.get("noted"):
                self._note_fault(attempt, now)
            self._recover(self._job(job.id), attempt, now)

    def _note_fault(self, attempt: AttemptRow, now: float) -> None:
        """Record ``fault_detected`` once per attempt, with when the fault really happened."""
        failure = dict(attempt.failure)
        if not failure or failure.get("noted") or attempt.cause == judging.CAUSE_CANCEL:
            return
        fault_at = failure.get("fault_at")
        if fault_at is None and "rank" in failure:
            rank = next(
                (r for r in self.store.ranks(attempt.id) if r.rank == failure["rank"]), None
            )
            fault_at = rank.ended_at if rank and rank.ended_at else now
            if failure.get("lost"):
                node = self.store.node(failure.get("node", ""))
                fault_at = node.last_heartbeat if node and node.last_heartbeat else now
        failure.update(noted=True, fault_at=fault_at or now)
        self.store.update_attempt(attempt.id, failure=failure)
        self.store.add_event(
            now,
            "fault_detected",
            job_id=attempt.job_id,
            attempt=attempt.number,
            node=failure.get("node"),
            fault=attempt.cause,
            fault_at=failure["fault_at"],
            reason=failure.get("reason") or judging.describe_failure(failure),
            rank=failure.get("rank"),
            nodes=failure.get("nodes", [failure.get("node")]),
        )

    def _stop_attempt(
        self, attempt: AttemptRow, cause: str, failure: dict[str, Any], now: float
    ) -> None:
        """Stop an attempt for a fault seen outside its ranks, and record the fault now."""
        super()._stop_attempt(attempt, cause, failure, now)
        stopped = self.store.attempt(attempt.id)
        if stopped is not None and stopped.state is AttemptState.STOPPING:
            self._note_fault(stopped, now)  # ended at once: _after_attempt noted it

    def _log_progress(self, attempt: AttemptRow, now: float) -> None:
        summary = progress.summarise(self._beacons.pop(attempt.id, {}))
        if summary:
            self.store.add_event(
                now, "attempt_progress", job_id=attempt.job_id, attempt=attempt.number, **summary
            )

    # -- deciding -------------------------------------------------------------------------
    def _fault_of(self, attempt: AttemptRow) -> Fault:
        f = attempt.failure
        known = f.get("classified")
        if known:  # decided when the attempt ended; node states have moved on since
            return Fault(
                FaultKind(known["kind"]), known["reason"], tuple(known["nodes"]), known["signature"]
            )
        try:
            kind = FaultKind(attempt.cause)
        except ValueError:
            kind = FaultKind.CRASH
        nodes = tuple(f.get("nodes") or ([f["node"]] if f.get("node") else []))
        reason = f.get("reason") or judging.describe_failure(f) or kind.value
        if kind is FaultKind.CRASH:
            # A rank that dies with its hardware, or whose peer's node died (Gloo/NCCL fail
            # at once with "connection closed"), is a node fault, not the job's: look at
            # every node of the attempt, not only the one whose rank exited first.
            held = [
                (n, row)
                for n in attempt.nodes
                if (row := self.store.node(n)) and row.state in _HELD | {NodeState.SUSPECT}
            ]
            if held:
                name, row = held[0]
                lost = row.state is NodeState.SUSPECT  # silent: quarantined in this same step
                default = FaultKind.NODE_LOST if lost else FaultKind.GPU_FAULT
                try:
                    node_kind = FaultKind(row.repair.get("kind") or default.value)
                except ValueError:
                    node_kind = default
                return Fault(
                    node_kind,
                    f"{reason}; {name} failed at the same time: {row.reason}",
                    tuple(n for n, _ in held),
                )
            sig = crash_signature(f.get("exit_code"), f.get("signal"), f.get("log_tail", ""))
            return Fault(kind, reason, nodes, sig)
        return Fault(kind, reason, nodes)

    def _node_views(self, job_id: int | None = None) -> list[NodeView]:
        """The nodes recovery may choose from: all of them, or on Slurm (``job_id`` given)
        only the job's own allocation: its spares are the allocated nodes it does not use."""
        rows = self.store.nodes()
        if self.external and job_id is not None:
            rows = [n for n in rows if n.allocation == job_id]
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
            for n in sorted(rows, key=self._node_order)
        ]

    def _recover(self, job: JobRow, attempt: AttemptRow, now: float) -> None:
        spec = self._spec(job)
        attempts = self.store.attempts(job.id)
        earlier = [a for a in attempts if a.number < attempt.number]
        part = spec.partition or self.cfg.default_partition
        view = JobView(
            id=job.id,
            auto_resume=spec.auto_resume,
            max_restarts=spec.max_restarts
            if spec.max_restarts is not None
            else self.cfg.max_restarts,
            restarts_used=sum(self._fault_of(a).kind.value in _COUNTING for a in earlier),
            node_restarts_used=_trailing(self._fault_of(a).kind.node_fault for a in earlier),
            nodes=spec.nodes,
            min_nodes=spec.min_nodes,
            groups=frozenset(self.cfg.partitions.get(part, [])),
            attempt_nodes=tuple(attempt.nodes),
            previous=self._fault_of(earlier[-1]) if earlier else None,
        )
        fault = self._fault_of(attempt)
        current = self.store.attempt(attempt.id)
        if current is not None and "classified" not in current.failure:
            classified = {
                "kind": fault.kind.value,
                "reason": fault.reason,
                "nodes": list(fault.nodes),
                "signature": fault.signature,
            }
            self.store.update_attempt(
                attempt.id, failure={**current.failure, "classified": classified}
            )
            if fault.kind.value != attempt.cause:
                # What looked like one thing when detected turned out another once torn down
                # (a peer's crash caused by a node that died): say so, the log stays true.
                self.store.add_event(
                    now,
                    "fault_classified",
                    job_id=job.id,
                    attempt=attempt.number,
                    node=fault.nodes[0] if fault.nodes else None,
                    fault=fault.kind.value,
                    was=attempt.cause,
                    nodes=list(fault.nodes),
                    reason=fault.reason,
                )
        decision = decide(view, fault, self._node_views(job.id))
        if job.cancel_requested and not isinstance(decision, Fail):
            # Cancelled while its fault was being torn down: never restart it.
            self._release_nodes(job.id, self._held_nodes(job.id), now)
            self._set_job(job, JobState.CANCELLED, now, reason="cancelled by request")
            self._bump()
            return
        self._execute(job, attempt, fault, decision, now)

    def _execute(
        self, job: JobRow, attempt: AttemptRow, fault: Fault, decision: Decision, now: float
    ) -> None:
        held = self._held_nodes(job.id)
        if isinstance(decision, Wait) and self.external and job.external:
            bad = sorted(fault.nodes) or sorted(set(attempt.nodes) - set(decision.keep))
            why = f"no spare left in the allocation; requeued in Slurm without {', '.join(bad)}"
            self._decision_event(job, attempt, "requeue", why, [], now, exclude=bad)
            self._requeue(job, bad, why, now)
        elif isinstance(decision, Wait):
            if job.state is JobState.RECOVERING and job.reason == decision.reason:
                return  # nothing new: still waiting for the same thing
            self._decision_event(job, attempt, "wait", decision.reason, list(decision.keep), now)
            self._release_nodes(job.id, [n for n in held if n not in decision.keep], now)
            self._set_job(job, JobState.RECOVERING, now, reason=decision.reason)
        elif isinstance(decision, Fail):
            self._decision_event(job, attempt, "fail", decision.reason, [], now)
            self._release_nodes(job.id, held, now)
            tail = str(attempt.failure.get("log_tail", "")).strip()
            reason = f"{decision.reason}\n{tail}" if tail else decision.reason
            self._set_job(job, JobState.FAILED, now, reason=reason)
        else:
            assert isinstance(decision, Restart)
            self._decision_event(
                job,
                attempt,
                "restart",
                decision.reason,
                list(decision.nodes),
                now,
                replaced=decision.replaced,
                counts=decision.counts,
                shrunk=decision.shrunk,
            )
            self._release_nodes(job.id, [n for n in held if n not in decision.nodes], now)
            if job.state is not JobState.RECOVERING:
                self._set_job(job, JobState.RECOVERING, now, reason=decision.reason)
            self._start_attempt(
                self._job(job.id),
                list(decision.nodes),
                now,
                restart_reason=f"{fault.kind.value}: {fault.reason}",
            )
        self._bump()

    def _decision_event(
        self,
        job: JobRow,
        attempt: AttemptRow,
        action: str,
        reason: str,
        nodes: list[str],
        now: float,
        **extra: Any,
    ) -> None:
        self.store.add_event(
            now,
            "recovery_decision",
            job_id=job.id,
            attempt=attempt.number,
            action=action,
            reason=reason,
            nodes=nodes,
            **extra,
        )

    def _retry_waiting(self, now: float) -> None:
        """Jobs waiting for a spare: decide again, since nodes may have come back."""
        for job in self.store.jobs([JobState.RECOVERING]):
            attempts = self.store.attempts(job.id)
            if attempts and attempts[-1].state is AttemptState.FAILED:
                self._recover(job, attempts[-1], now)

    # -- quarantine and repair ------------------------------------------------------------
    def _quarantine(
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
        if node.state in _HELD:
            return
        request = {"requested": repair, "kind": kind.value, "since": now}
        self._set_node(node, NodeState.QUARANTINED, now, reason=reason, repair=request)
        if self.external:
            self._ops_call("drain", now, self.ops.drain, node.name, reason, node=node.name)
        if node.job_id is None:
            return
        attempt = self._active_attempt(node.job_id)
        if attempt is not None and node.name in attempt.nodes:
            failure = {
                "reason": f"{node.name}: {reason}",
                "nodes": [node.name],
                "node": node.name,
                "fault_at": fault_at or now,
            }
            self._stop_attempt(attempt, kind.value, failure, now)

    def _repair_step(self, now: float) -> None:
        for node in self.store.nodes():
            rep = node.repair
            if node.state is NodeState.QUARANTINED and rep.get("requested"):
                if node.job_id is not None:
                    continue  # its attempt is still being torn down
                if self.repairer is not None:
                    self._begin_repair(node, "replace", now)
                elif self.external and self._agent_alive(node, now):
                    # Slurm nodes cannot be re-provisioned from here: check the node in
                    # place through its live agent; a pass resumes it in Slurm.
                    self._begin_repair(node, "check", now)
            elif node.state is NodeState.REPAIRING:
                limit = rep.get("started_at", now) + self.cfg.deep_check_timeout_s + REPAIR_SLACK_S
                if now > limit:
                    self._repair_failed(node, "repair did not finish in time", now)

    def _begin_repair(self, node: NodeRow, mode: str, now: float) -> None:
        rep = {
            "mode": mode,
            "started_at": now,
            "old_agent": node.agent_id if mode == "replace" else None,
            "kind": node.repair.get("kind", ""),
        }
        self._set_node(node, NodeState.REPAIRING, now, reason=f"repairing ({mode})", repair=rep)
        if mode == "replace":
            repairer = self.repairer
            assert repairer is not None
            threading.Thread(target=_run_repairer, args=(repairer, node.name), daemon=True).start()
        self._bump()

    def _repair_on_heartbeat(self, node: NodeRow, hb: Heartbeat, now: float) -> None:
        rep = dict(node.repair)
        if rep.get("mode") == "replace" and hb.agent_id == rep.get("old_agent"):
            return  # the old instance is still reporting; the new one is not up yet
        if hb.lifecycle.state == "failed":
            self._repair_failed(node, lifecycle_failure(hb.lifecycle.results), now)
            return
        if hb.lifecycle.state != "ok":
            return
        if not rep.get("deep_check_id"):
            rep["deep_check_id"] = uuid.uuid4().hex[:12]
            self.store.update_node(node.name, now, repair=rep)
            self.store.add_event(now, "deep_check_started", node=node.name, id=rep["deep_check_id"])
            self._bump()
            return
        result = hb.deep_check
        if result is None or result.id != rep["deep_check_id"] or result.status == "running":
            return
        self.store.add_event(
            now,
            "deep_check_finished",
            node=node.name,
            status=result.status,
            reason=result.reason,
        )
        if result.status == "fault":
            self._repair_failed(node, f"deep check failed: {result.reason}", now)
            return
        self._set_node(node, NodeState.IDLE, now, reason="", repair={}, repairs=0, job_id=None)
        self.store.add_event(now, "node_repaired", node=node.name, mode=rep.get("mode"))
        if self.external:
            self._ops_call("resume", now, self.ops.resume, node.name, node=node.name)
        self._bump()

    def _repair_failed(self, node: NodeRow, reason: str, now: float) -> None:
        failures = node.repairs + 1
        if failures >= self.cfg.retire_after:
            self._set_node(
                node,
                NodeState.RETIRED,
                now,
                repairs=failures,
                repair={},
                reason=f"retired after {failures} failed repairs; last: {reason}",
            )
        else:
            again = {
                "requested": self.cfg.auto_repair,
                "kind": node.repair.get("kind", ""),
                "since": now,
            }
            self._set_node(
                node,
                NodeState.QUARANTINED,
                now,
                repairs=failures,
                repair=again,
                reason=f"repair {failures} failed: {reason}",
            )
        self._bump()

    def _agent_alive(self, node: NodeRow, now: float) -> bool:
        return (
            node.agent_id is not None
            and node.last_heartbeat is not None
            and now - node.last_heartbeat <= self.cfg.heartbeat_timeout_s
        )

    def _slurm_down(self, node: NodeRow, why: str, now: float) -> None:
        reason = f"Slurm marks the node down: {why}"
        self.store.add_event(now, "external_node_down", node=node.name, reason=why)
        self._quarantine(node, reason, FaultKind.NODE_LOST, now, repair=self.cfg.auto_repair)

    # -- operators --------------------------------------------------------------------------
    def node_action(self, name: str, action: NodeAction) -> NodeRow:
        """drain | quarantine | resume | replace a node, with the operator's reason."""
        now = self.clock.now()
        with self._lock, self.store.transaction():
            node = self._node(name)
            why = f"operator: {action.reason}"
            self.store.add_event(now, f"node_{action.action}", node=name, reason=action.reason)
            if action.action == "drain":
                self.store.update_node(name, now, drained=True, reason=f"drained ({why})")
                if self.external:
                    self._ops_call("drain", now, self.ops.drain, name, why, node=name)
            elif action.action == "quarantine":
                self._quarantine(node, why, FaultKind.QUARANTINED, now, repair=False)
            elif action.action == "replace":
                if self.repairer is None:
                    raise Conflict(f"the {self.cfg.backend} backend cannot replace nodes")
                self._quarantine(node, why, FaultKind.QUARANTINED, now, repair=True)
                node = self._node(name)
                if node.state is NodeState.QUARANTINED:
                    rep = {**node.repair, "requested": True}
                    self.store.update_node(name, now, repair=rep, reason=why)
            else:
                self.store.update_node(name, now, drained=False)
                node = self._node(name)
                if node.state in (NodeState.QUARANTINED, NodeState.RETIRED):
                    self._begin_repair(node, "check", now)
                elif node.state is NodeState.FAILED:
                    if self.repairer is None:
                        raise Conflict(
                            f"{name} failed its lifecycle scripts; fix them and restart the node"
                        )
                    self._begin_repair(node, "replace", now)
                elif node.state in HEALTHY_NODE_STATES:
                    self.store.update_node(name, now, reason="")
                    if self.external:
                        self._ops_call("resume", now, self.ops.resume, name, node=name)
            self._bump()
            return self._node(name)


def _trailing(flags: Iterable[bool]) -> int:
    """How many of the last ``flags`` are true in a row (node faults since the last other)."""
    run = 0
    for flag in flags:
        run = run + 1 if flag else 0
    return run


def _reason(failure: dict[str, Any]) -> str:
    text = failure.get("reason") or judging.describe_failure(failure)
    tail = str(failure.get("log_tail", "")).strip()
    return f"{text}\n{tail}" if tail else str(text)


def _run_repairer(repairer: Callable[[str], None], node: str) -> None:
    try:
        repairer(node)
    except Exception:  # the repair's timeout in _repair_step turns this into a failed repair
        log.exception("replacing node %s failed", node)
