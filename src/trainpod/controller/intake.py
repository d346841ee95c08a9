"""Heartbeat intake: what one agent's report changes, one named step per concern.

:meth:`HeartbeatIngest.apply` runs under the controller's lock, in one store
transaction: identity (a new or reconnected agent), the scheduling strategy's allocation
bookkeeping, the node's state (or its repair), progress beacons, checkpoint reports, rank
reports (started, exited, lost with a restarted agent), health and chaos acknowledgements.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pydantic_core

from trainpod.api.models import AttemptReport, HealthResult, Heartbeat, LifecycleStatus
from trainpod.controller.books import BeaconBook, ChaosBook
from trainpod.controller.checkpoints import CheckpointEvents
from trainpod.controller.config import ControllerConfig
from trainpod.controller.executor import Executor
from trainpod.controller.external import Scheduling
from trainpod.controller.nodes import node_state_after_heartbeat
from trainpod.controller.policy import FaultKind
from trainpod.controller.repair import NodeRepair
from trainpod.controller.telemetry import Holder, TelemetryBook
from trainpod.controller.transitions import Transitions
from trainpod.errors import NotFound
from trainpod.model.events import (
    AgentReconnected,
    AgentRegistered,
    FirstBeacon,
    RankExited,
    RankStarted,
)
from trainpod.model.states import NodeState, RankState
from trainpod.scheduler.base import Preempt
from trainpod.store.repo import Store
from trainpod.store.rows import NodeRow

# Nodes that a failed health check no longer moves (already out of service).
_FAULT_FREE = {NodeState.QUARANTINED, NodeState.REPAIRING, NodeState.RETIRED, NodeState.STOPPED}


@dataclass(frozen=True)
class _Facts:
    """A node's facts column as the intake last wrote it, and the report it came from."""

    facts: dict[str, Any]
    lifecycle: LifecycleStatus
    health: list[HealthResult]
    text: str


@dataclass
class HeartbeatIngest:
    store: Store
    cfg: ControllerConfig
    tx: Transitions
    scheduling: Scheduling
    executor: Executor
    repair: NodeRepair
    beacons: BeaconBook
    chaos: ChaosBook
    checkpoints: CheckpointEvents
    telemetry: TelemetryBook
    agents_seen: dict[str, str] = field(
        default_factory=dict, init=False
    )  # node -> agent id heard from since start
    running: dict[str, set[int]] = field(
        default_factory=dict, init=False
    )  # node -> attempts with live ranks there
    facts_written: dict[str, _Facts] = field(
        default_factory=dict, init=False
    )  # node -> what its facts column was last written from (one entry per node)

    def apply(self, hb: Heartbeat, now: float) -> None:
        node, new_agent = self._identify(hb, now)
        node = self.scheduling.heartbeat(node, hb, now)
        self._preempted_externally(node, hb, now)
        self._node_state(node, hb, now)
        self._beacons(hb, now)
        self._telemetry(node, hb, now)
        self.checkpoints.record(self.store, hb, now)
        touched = self._rank_reports(node.name, hb.attempts, now)
        if new_agent:
            touched |= self._lose_unreported(node.name, hb.attempts, now)
        touched |= self._lose_forgotten(node.name, hb.forgotten, now)
        self.running[node.name] = {
            a.attempt_id for a in hb.attempts if any(r.state == "running" for r in a.ranks)
        }
        tails = {r.rank: r.log_tail for a in hb.attempts for r in a.ranks if r.log_tail}
        for attempt_id in touched:
            self.executor.reconcile(attempt_id, now, tails)
        self._health(node.name, hb, now)
        self.chaos.acknowledged(node.name, hb.chaos_done)

    # -- the steps ------------------------------------------------------------------------
    def _preempted_externally(self, node: NodeRow, hb: Heartbeat, now: float) -> None:
        """The external scheduler (Slurm) preempts the allocation this agent runs in: the
        job's attempt stops as a preemption (its ranks have the notice from their agent),
        before any exit in this beat is judged, so the job waits as ``preempted``."""
        if node.allocation is None or not self.scheduling.preempted(hb):
            return
        attempt = self.tx.active_attempt(node.allocation)
        if attempt is None or attempt.state.ended:
            return
        why = "preempted by Slurm (its nodes are wanted by a job of a higher tier)"
        self.executor.preempt(Preempt(node.allocation, why, self.cfg.preemption.grace_s), now)

    def _identify(self, hb: Heartbeat, now: float) -> tuple[NodeRow, bool]:
        """The node the agent reports for, with its identity recorded; True: a new agent."""
        node = self.store.node(hb.node) or self.scheduling.unknown_node(hb, now)
        if node is None:
            raise NotFound(
                f"node {hb.node!r} is not part of cluster {self.cfg.cluster}; "
                "was the agent started for another cluster?"
            )
        new_agent = node.agent_id != hb.agent_id
        if new_agent:
            self.store.append(
                now,
                AgentRegistered(
                    node=node.name,
                    agent_pid=hb.agent_pid,
                    address=hb.address,
                    restarted=node.agent_id is not None,
                ),
            )
            self.chaos.drop(node.name)
        elif self.agents_seen.get(node.name) != hb.agent_id:
            self.store.append(now, AgentReconnected(node=node.name))
        self.agents_seen[node.name] = hb.agent_id
        facts_json = self._facts_json(node, hb)
        changed = {"facts": facts_json} if facts_json is not node.facts_json else {}
        self.store.update_node(
            node.name,
            now,
            last_heartbeat=now,
            address=hb.address,
            agent_id=hb.agent_id,
            agent_pid=hb.agent_pid,
            **changed,
        )
        # The row as just written, without reading (and decoding) it back.
        row = replace(
            node,
            last_heartbeat=now,
            address=hb.address,
            agent_id=hb.agent_id,
            agent_pid=hb.agent_pid,
            facts_json=facts_json,
            updated_at=now,
        )
        return row, new_agent

    def _facts_json(self, node: NodeRow, hb: Heartbeat) -> str:
        """The node's facts column for this beat: the row's own (the same object) when the
        beat reports the same facts, lifecycle and health as the one that wrote it, as an
        agent does beat after beat; else encoded afresh (pydantic's encoder: the stdlib's
        costs several times as much for a real agent's ~2 KB of facts and health)."""
        last = self.facts_written.get(node.name)
        if (
            last is not None
            and last.text == node.facts_json
            and last.facts == hb.facts
            and last.lifecycle == hb.lifecycle
            and last.health == hb.health
        ):
            return node.facts_json
        facts = {
            **hb.facts,
            "lifecycle": hb.lifecycle.model_dump(),
            "health": [h.model_dump() for h in hb.health],
        }
        text = pydantic_core.to_json(facts).decode()
        self.facts_written[node.name] = _Facts(hb.facts, hb.lifecycle, hb.health, text)
        return text

    def _node_state(self, node: NodeRow, hb: Heartbeat, now: float) -> None:
        if node.state is NodeState.REPAIRING:
            self.repair.on_heartbeat(node, hb, now)
            return
        target, reason = node_state_after_heartbeat(node, hb)
        if target is not None and target != node.state:
            self.tx.set_node(node, target, now, reason=reason)

    def _telemetry(self, node: NodeRow, hb: Heartbeat, now: float) -> None:
        """The one place the heartbeat's device telemetry is read: into the node's rings,
        its energy to the attempt of the job holding the node (or to idle)."""
        if hb.leaving:
            self.telemetry.forget(node.name)
            return
        if not hb.telemetry:
            return
        holder = Holder()
        if node.job_id is not None:
            attempt = self.tx.active_attempt(node.job_id)
            holder = Holder(node.job_id, attempt.number if attempt is not None else 0)
        self.telemetry.record(node.name, hb.telemetry, holder, now)

    def _beacons(self, hb: Heartbeat, now: float) -> None:
        for rep in hb.attempts:
            if not rep.beacons:
                continue
            attempt = self.store.attempt(rep.attempt_id)
            if attempt is None or attempt.state.ended:
                continue  # its book was summarised when it ended
            mine = {r.rank for r in self.store.ranks(attempt.id) if r.node == hb.node}
            beacons = [b for b in rep.beacons if b.rank in mine]  # never trust a rank number
            if not beacons:
                continue
            self.beacons.record(attempt.id, beacons, now)
            self.beacons.history.add(attempt.job_id, attempt.number, beacons, now)
            if attempt.in_process.pending and self.executor.rung.confirm(attempt, now):
                self.tx.wake.bump()  # every rank joined the new generation (ADR 0035)
            if attempt.id in self.beacons.first_logged:
                continue
            self.beacons.first_logged.add(attempt.id)
            if not self.store.has_event(attempt.job_id, FirstBeacon.kind, attempt.number):
                first = min(beacons, key=lambda b: b.first_at)
                self.store.append(
                    now,
                    FirstBeacon(
                        node=hb.node,
                        job_id=attempt.job_id,
                        attempt=attempt.number,
                        rank=first.rank,
                        at=first.first_at,
                        step=first.first_step,
                    ),
                )

    def _rank_reports(self, node: str, reports: list[AttemptReport], now: float) -> set[int]:
        touched: set[int] = set()
        for rep in reports:
            attempt = self.store.attempt(rep.attempt_id)
            if attempt is None:
                continue
            rows = {r.rank: r for r in self.store.ranks(attempt.id)}
            for rr in rep.ranks:
                row = rows.get(rr.rank)
                if row is None or row.node != node:
                    continue
                if row.state.ended:  # final, unless started again in process (ADR 0026)
                    rung = self.executor.rung
                    if rr.state == "running" and rung.restarted(
                        attempt, row, rr.pid, rr.started_at, now
                    ):
                        touched.add(attempt.id)
                    continue
                if row.state is RankState.PENDING:
                    self.store.update_rank(
                        attempt.id,
                        rr.rank,
                        state=RankState.RUNNING,
                        pid=rr.pid,
                        started_at=rr.started_at or now,
                    )
                    self.store.append(
                        now,
                        RankStarted(
                            node=node,
                            job_id=attempt.job_id,
                            attempt=attempt.number,
                            rank=rr.rank,
                            pid=rr.pid,
                            started_at=rr.started_at,
                        ),
                    )
                    touched.add(attempt.id)
                elif row.pid is None and rr.pid is not None and rr.state == "running":
                    # reported running before its process existed (the agent lists every
                    # rank of an attempt before it spawns the first; a warm start learns its
                    # pid from the zygote): the pid comes with a later report
                    self.store.update_rank(attempt.id, rr.rank, pid=rr.pid)
                elif (
                    rr.state == "running"
                    and rr.pid not in (None, row.pid)
                    # another process of a running rank: a stuck one replaced in process
                    # (killed and started again before a report saw it end; ADR 0026)
                    and self.executor.rung.restarted(attempt, row, rr.pid, rr.started_at, now)
                ):
                    touched.add(attempt.id)
                if rr.state == "running":
                    self.beacons.record_idle(attempt.id, rr.rank, rr.idle_s, now)
                if rr.state == "exited":
                    self.store.update_rank(
                        attempt.id,
                        rr.rank,
                        state=RankState.EXITED,
                        exit_code=rr.exit_code,
                        signal=rr.signal,
                        ended_at=rr.ended_at or now,
                    )
                    self.store.append(
                        now,
                        RankExited(
                            node=node,
                            job_id=attempt.job_id,
                            attempt=attempt.number,
                            rank=rr.rank,
                            exited_at=rr.ended_at,
                            exit_code=rr.exit_code,
                            signal=rr.signal,
                            # the log's end only for a rank that failed
                            log_tail=rr.log_tail if rr.exit_code != 0 else None,
                        ),
                    )
                    touched.add(attempt.id)
        return touched

    def _lose_unreported(self, node: str, reports: list[AttemptReport], now: float) -> set[int]:
        """A new agent knows nothing of the ranks its predecessor ran: they are lost."""
        reported = {(a.attempt_id, r.rank) for a in reports for r in a.ranks}
        touched: set[int] = set()
        for attempt in self.store.active_attempts():
            if node not in attempt.nodes:
                continue
            for r in self.store.ranks(attempt.id):
                live = r.node == node and r.state is RankState.RUNNING
                if live and (attempt.id, r.rank) not in reported:
                    self.tx.lose_rank(attempt, r.rank, node, now, "agent restarted")
                    touched.add(attempt.id)
        return touched

    def _lose_forgotten(self, node: str, forgotten: list[int], now: float) -> set[int]:
        """Ranks here of an attempt the agent says it has forgotten, that the controller
        still holds live, were lost: the agent forgets an attempt only after the controller
        has acknowledged every rank's exit, so their exits never arrived, and nothing
        would ever end them (the attempt stayed ``launching`` for good).

        A beat read its ``forgotten`` with its reports, after the launch it lists: a beat
        from before (the agent's other thread, arriving late) lists the attempt in neither
        and is not taken for a loss."""
        touched: set[int] = set()
        for attempt_id in forgotten:
            attempt = self.store.attempt(attempt_id)
            if attempt is None or attempt.state.ended or node not in attempt.nodes:
                continue
            for r in self.store.ranks(attempt.id):
                if r.node == node and not r.state.ended:
                    why = "its agent no longer reports it (forgotten before its exit was heard)"
                    self.tx.lose_rank(attempt, r.rank, node, now, why)
                    touched.add(attempt.id)
        return touched

    def _health(self, name: str, hb: Heartbeat, now: float) -> None:
        """A FAULT from any health check quarantines the node (and stops its attempt)."""
        faults = [h for h in hb.health if h.status == "fault"]
        if not faults or hb.leaving:
            return
        node = self.tx.node(name)  # as the steps before left it
        if node.state in _FAULT_FREE:
            return
        kind = FaultKind.GPU_FAULT if faults[0].check == "gpu" else FaultKind.NODE_FAULT
        reason = "; ".join(f"{h.check}: {h.reason}" for h in faults)
        self.executor.quarantine(node, reason, kind, now, repair=self.cfg.auto_repair)
