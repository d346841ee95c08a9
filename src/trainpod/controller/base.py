"""The controller's shared machinery: locking, versioned wake-ups and checked state changes.

Everything here runs with the controller's lock held and inside a store transaction; a
state change and its event are written together.
"""

from __future__ import annotations

import threading
from typing import Any

from trainpod.agent.beacons import StragglerTracker
from trainpod.api.models import ChaosOrder, RankBeacon
from trainpod.clock import Clock, SystemClock
from trainpod.controller import judge as judging
from trainpod.controller.checkpoints import CheckpointEvents
from trainpod.controller.config import ControllerConfig
from trainpod.controller.ops import ClusterOps
from trainpod.controller.ports import PortAllocator, free_port
from trainpod.controller.states import (
    ATTEMPT_TRANSITIONS,
    JOB_TRANSITIONS,
    NODE_TRANSITIONS,
    AttemptState,
    JobState,
    NodeState,
    RankState,
    check,
)
from trainpod.errors import NotFound
from trainpod.scheduler.fifo import QueuedJob
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.store.rows import AttemptRow, JobRow, NodeRow

# States in which a node is fit to run work (or to be given some).
HEALTHY_NODE_STATES = {NodeState.IDLE, NodeState.ALLOCATED}


class ControllerBase:
    def __init__(
        self,
        store: Store,
        config: ControllerConfig,
        *,
        clock: Clock | None = None,
        ports: PortAllocator = free_port,
    ) -> None:
        self.store = store
        self.cfg = config
        self.clock = clock or SystemClock()
        self._ports = ports
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._version = 0
        self.wakeup = threading.Event()  # set when step() has work to do
        self._agents_seen: set[str] = set()  # agent ids heard from since this process started
        self._agent_running: dict[str, set[int]] = {}  # node -> attempts with live ranks
        self.started_at = self.clock.now()
        self._order = {d.name: i for i, d in enumerate(config.nodes)}
        self._queue: dict[int, QueuedJob] = {}  # parsed once per queued job
        self._scheduled_at_version = -1
        # Progress beacons by attempt and rank, with the controller time they arrived.
        self._beacons: dict[int, dict[int, tuple[RankBeacon, float]]] = {}
        self._first_beacon_logged: set[int] = set()
        self._chaos: dict[str, list[ChaosOrder]] = {}  # node -> pending chaos orders
        self._straggling: dict[int, tuple[StragglerTracker, float]] = {}  # attempt -> tracker
        self._checkpoints = CheckpointEvents()  # agents' checkpoint reports -> events
        self.ops: ClusterOps = ClusterOps()  # the external scheduler's seam (Slurm); none
        self._stale_agents: set[str] = set()
        self._reaped: set[int] = set()  # jobs whose orphaned Slurm job was cancelled
        self._released: set[tuple[int, str]] = set()  # Slurm holds already released
        self._mtbf: dict[int, dict[str, str]] = {}  # attempt -> observed MTBF env

    # -- wake-ups -------------------------------------------------------------------------
    def _bump(self) -> None:
        self._version += 1
        self._changed.notify_all()
        self.wakeup.set()

    # -- checked state changes --------------------------------------------------------------
    def _set_node(self, node: NodeRow, state: NodeState, now: float, **fields: Any) -> None:
        check("node", NODE_TRANSITIONS, node.state, state)
        self.store.update_node(node.name, now, state=state, **fields)
        if state != node.state:
            self.store.add_event(
                now,
                "node_state",
                node=node.name,
                old=node.state.value,
                new=state.value,
                reason=fields.get("reason", ""),
            )

    def _set_job(self, job: JobRow, state: JobState, now: float, **fields: Any) -> None:
        check("job", JOB_TRANSITIONS, job.state, state)
        if state.ended:
            fields.setdefault("ended_at", now)
        self.store.update_job(job.id, now, state=state, **fields)
        if state != job.state:
            self.store.add_event(
                now,
                "job_state",
                job_id=job.id,
                old=job.state.value,
                new=state.value,
                reason=fields.get("reason", ""),
            )

    def _set_attempt(
        self, attempt: AttemptRow, state: AttemptState, now: float, **fields: Any
    ) -> None:
        check("attempt", ATTEMPT_TRANSITIONS, attempt.state, state)
        if state.ended:
            fields.setdefault("ended_at", now)
        self.store.update_attempt(attempt.id, state=state, **fields)
        self.store.add_event(
            now,
            "attempt_state",
            job_id=attempt.job_id,
            attempt=attempt.number,
            old=attempt.state.value,
            new=state.value,
            cause=fields.get("cause", attempt.cause),
        )

    # -- lookups ----------------------------------------------------------------------------
    def _job(self, job_id: int) -> JobRow:
        job = self.store.job(job_id)
        if job is None:
            raise NotFound(f"no job {job_id} on cluster {self.cfg.cluster}; see `trainpod jobs`")
        return job

    def _node(self, name: str) -> NodeRow:
        node = self.store.node(name)
        if node is None:
            raise NotFound(f"no node {name!r} on cluster {self.cfg.cluster}; see `trainpod nodes`")
        return node

    def _spec(self, job: JobRow) -> JobSpec:
        return JobSpec.model_validate(job.spec)

    def _address(self, node: str) -> str:
        row = self.store.node(node)
        return (row.address if row else None) or "127.0.0.1"

    def _node_order(self, node: NodeRow) -> tuple[int, str]:
        return (self._order.get(node.name, len(self._order)), node.name)

    def _schedulable(self) -> list[NodeRow]:
        """Idle, undrained, non-spare compute nodes, in spec order."""
        nodes = [
            n
            for n in self.store.nodes()
            if n.state is NodeState.IDLE and not n.spare and n.role == "compute" and not n.drained
        ]
        return sorted(nodes, key=self._node_order)

    def _active_attempt(self, job_id: int) -> AttemptRow | None:
        for a in self.store.attempts(job_id):
            if not a.state.ended:
                return a
        return None

    # -- attempts ---------------------------------------------------------------------------
    def _start_attempt(
        self, job: JobRow, nodes: list[str], now: float, restart_reason: str = ""
    ) -> AttemptRow:
        """Create the next attempt of ``job`` on ``nodes`` (allocating them) with a new port."""
        spec = self._spec(job)
        number = len(self.store.attempts(job.id)) + 1
        addr = self._address(nodes[0])
        port = self._ports(addr)
        attempt_id = self.store.insert_attempt(
            job.id, number, nodes, addr, port, spec.procs_per_node or 1, now, restart_reason
        )
        for name in nodes:
            node = self._node(name)
            self._set_node(node, NodeState.ALLOCATED, now, job_id=job.id, reason="")
        self._set_job(self._job(job.id), JobState.STARTING, now)
        self.store.add_event(
            now,
            "attempt_created",
            job_id=job.id,
            attempt=number,
            attempt_id=attempt_id,
            nodes=nodes,
            master_addr=addr,
            master_port=port,
            restart_reason=restart_reason,
        )
        attempt = self.store.attempt(attempt_id)
        assert attempt is not None
        return attempt

    def _lose_rank(self, attempt: AttemptRow, rank: int, node: str, now: float, why: str) -> None:
        self.store.update_rank(attempt.id, rank, state=RankState.LOST, ended_at=now)
        self.store.add_event(
            now,
            "rank_lost",
            node=node,
            job_id=attempt.job_id,
            attempt=attempt.number,
            rank=rank,
            reason=why,
        )

    def _stop_attempt(
        self, attempt: AttemptRow, cause: str, failure: dict[str, Any], now: float
    ) -> None:
        """Begin tearing an attempt down because of a fault seen outside its ranks."""
        if attempt.state.ended or attempt.state is AttemptState.STOPPING:
            return
        self._set_attempt(attempt, AttemptState.STOPPING, now, cause=cause, failure=failure)
        job = self._job(attempt.job_id)
        if job.state in (JobState.STARTING, JobState.RUNNING):
            self._set_job(job, JobState.STOPPING, now, reason=failure.get("reason", cause))
        self._reconcile(attempt.id, now, {})

    def _reconcile(self, attempt_id: int, now: float, tails: dict[int, str]) -> None:
        attempt = self.store.attempt(attempt_id)
        if attempt is None:
            return
        job = self._job(attempt.job_id)
        ranks = self.store.ranks(attempt.id)
        verdict = judging.judge(attempt, ranks, cancel_requested=job.cancel_requested, tails=tails)
        if verdict is None:
            return
        fields: dict[str, Any] = {}
        if verdict.state is AttemptState.RUNNING:
            fields["started_at"] = now
        if verdict.cause:
            fields["cause"] = verdict.cause
        if verdict.failure:
            fields["failure"] = verdict.failure
        self._set_attempt(attempt, verdict.state, now, **fields)
        ended = self.store.attempt(attempt.id)
        assert ended is not None
        self._after_attempt(self._job(job.id), ended, verdict, now)

    def _after_attempt(
        self, job: JobRow, attempt: AttemptRow, verdict: judging.Verdict, now: float
    ) -> None:
        raise NotImplementedError  # provided by the recovery mixin

    def _release_nodes(self, job_id: int, names: list[str], now: float) -> None:
        """Give ``names`` (those still held by ``job_id``) back to the pool."""
        for name in names:
            node = self.store.node(name)
            if node is None or node.job_id != job_id:
                continue
            if node.state is NodeState.ALLOCATED:
                self._set_node(node, NodeState.IDLE, now, job_id=None, reason="")
            else:
                self.store.update_node(name, now, job_id=None)
            self.store.add_event(now, "node_released", node=name, job_id=job_id)

    def _held_nodes(self, job_id: int) -> list[str]:
        return [n.name for n in self.store.nodes() if n.job_id == job_id]
