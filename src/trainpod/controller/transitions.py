"""Checked state changes with their events, and the lookups every collaborator needs.

Everything here runs with the controller's lock held and inside a store transaction; a
state change and its event are written together. Nothing here decides anything.
"""

from __future__ import annotations

from typing import Any

from trainpod.controller.config import ControllerConfig
from trainpod.controller.ports import PortAllocator
from trainpod.controller.wake import Wake
from trainpod.errors import NotFound
from trainpod.model.events import (
    AttemptCreated,
    AttemptStateChanged,
    JobStateChanged,
    NodeReleased,
    NodeStateChanged,
    RankLost,
)
from trainpod.model.states import (
    ATTEMPT_TRANSITIONS,
    JOB_TRANSITIONS,
    NODE_TRANSITIONS,
    AttemptState,
    JobState,
    NodeState,
    RankState,
    check,
)
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.store.rows import AttemptRow, JobRow, NodeRow
from trainpod.store.secrets import JobSecrets

# States in which a node is fit to run work (or to be given some).
HEALTHY_NODE_STATES = frozenset({NodeState.IDLE, NodeState.ALLOCATED})
# States that only the recovery engine or an operator moves a node out of.
HELD_NODE_STATES = frozenset({NodeState.QUARANTINED, NodeState.REPAIRING, NodeState.RETIRED})


class Transitions:
    def __init__(
        self,
        store: Store,
        config: ControllerConfig,
        wake: Wake,
        ports: PortAllocator,
        secrets: JobSecrets,
    ) -> None:
        self.store = store
        self.secrets = secrets
        """Jobs' secret env values: put at submission, read for launch orders, forgotten
        when the job ends (here, with the state change)."""
        self.cfg = config
        self.wake = wake
        self._ports = ports
        self._order = {d.name: i for i, d in enumerate(config.nodes)}
        self.released = 0
        """Nodes given back so far: a caller compares it before and after a change."""

    # -- lookups ----------------------------------------------------------------------------
    def job(self, job_id: int) -> JobRow:
        job = self.store.job(job_id)
        if job is None:
            raise NotFound(f"no job {job_id} on cluster {self.cfg.cluster}; see `trainpod jobs`")
        return job

    def node(self, name: str) -> NodeRow:
        node = self.store.node(name)
        if node is None:
            raise NotFound(f"no node {name!r} on cluster {self.cfg.cluster}; see `trainpod nodes`")
        return node

    @staticmethod
    def spec(job: JobRow) -> JobSpec:
        return JobSpec.model_validate(job.spec)

    def address(self, node: str) -> str:
        row = self.store.node(node)
        return (row.address if row else None) or "127.0.0.1"

    def node_order(self, node: NodeRow) -> tuple[int, str]:
        return (self._order.get(node.name, len(self._order)), node.name)

    def learn_node(self, name: str) -> None:
        """A node the spec did not declare (Slurm): it sorts after the declared ones."""
        self._order.setdefault(name, len(self._order))

    def active_attempt(self, job_id: int) -> AttemptRow | None:
        for a in self.store.attempts(job_id):
            if not a.state.ended:
                return a
        return None

    def held_nodes(self, job_id: int) -> list[str]:
        return [n.name for n in self.store.nodes() if n.job_id == job_id]

    # -- checked state changes --------------------------------------------------------------
    def set_node(self, node: NodeRow, state: NodeState, now: float, **fields: Any) -> None:
        check("node", NODE_TRANSITIONS, node.state, state)
        self.store.update_node(node.name, now, state=state, **fields)
        if state != node.state:
            self.store.append(
                now,
                NodeStateChanged(
                    node=node.name, old=node.state, new=state, reason=fields.get("reason", "")
                ),
            )

    def set_job(self, job: JobRow, state: JobState, now: float, **fields: Any) -> None:
        check("job", JOB_TRANSITIONS, job.state, state)
        if state.ended:
            fields.setdefault("ended_at", now)
            self.secrets.forget(job.id)  # no attempt of it will launch again
        self.store.update_job(job.id, now, state=state, **fields)
        if state != job.state:
            self.store.append(
                now,
                JobStateChanged(
                    job_id=job.id, old=job.state, new=state, reason=fields.get("reason", "")
                ),
            )

    def set_attempt(
        self, attempt: AttemptRow, state: AttemptState, now: float, **fields: Any
    ) -> None:
        check("attempt", ATTEMPT_TRANSITIONS, attempt.state, state)
        if state.ended:
            fields.setdefault("ended_at", now)
        self.store.update_attempt(attempt.id, state=state, **fields)
        self.store.append(
            now,
            AttemptStateChanged(
                job_id=attempt.job_id,
                attempt=attempt.number,
                old=attempt.state,
                new=state,
                cause=fields.get("cause", attempt.cause),
            ),
        )

    # -- attempts and nodes -------------------------------------------------------------------
    def new_port(self, addr: str) -> int:
        """A fresh port on ``addr`` for a rendezvous store (an attempt's, or a new generation's)."""
        return self._ports(addr)

    def start_attempt(
        self,
        job: JobRow,
        nodes: list[str],
        now: float,
        restart_reason: str = "",
        lent_by: tuple[int, ...] = (),
    ) -> AttemptRow:
        """Create the next attempt of ``job`` on ``nodes`` (allocating them) with a new port;
        ``lent_by``: the waiting jobs whose reserved nodes these are (ADR 0050)."""
        spec = self.spec(job)
        number = len(self.store.attempts(job.id)) + 1
        addr = self.address(nodes[0])
        port = self._ports(addr)
        attempt_id = self.store.insert_attempt(
            job.id,
            number,
            nodes,
            addr,
            port,
            spec.procs_per_node or 1,
            now,
            restart_reason,
            lent_by,
        )
        for name in nodes:
            self.set_node(self.node(name), NodeState.ALLOCATED, now, job_id=job.id, reason="")
        self.set_job(self.job(job.id), JobState.STARTING, now)
        self.store.append(
            now,
            AttemptCreated(
                job_id=job.id,
                attempt=number,
                attempt_id=attempt_id,
                nodes=tuple(nodes),
                master_addr=addr,
                master_port=port,
                reason=restart_reason,
                lent_by=lent_by or None,
            ),
        )
        attempt = self.store.attempt(attempt_id)
        assert attempt is not None
        return attempt

    def lose_rank(self, attempt: AttemptRow, rank: int, node: str, now: float, why: str) -> None:
        self.store.update_rank(attempt.id, rank, state=RankState.LOST, ended_at=now)
        self.store.append(
            now,
            RankLost(
                node=node, job_id=attempt.job_id, attempt=attempt.number, rank=rank, reason=why
            ),
        )

    def release_nodes(self, job_id: int, names: list[str], now: float) -> None:
        """Give ``names`` (those still held by ``job_id``) back to the pool."""
        for name in names:
            node = self.store.node(name)
            if node is None or node.job_id != job_id:
                continue
            if node.state is NodeState.ALLOCATED:
                self.set_node(node, NodeState.IDLE, now, job_id=None, reason="")
            else:
                self.store.update_node(name, now, job_id=None)
            self.store.append(now, NodeReleased(node=name, job_id=job_id))
            self.released += 1

    def release_all(self, job_id: int, now: float) -> None:
        self.release_nodes(job_id, self.held_nodes(job_id), now)
