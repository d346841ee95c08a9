"""The controller: owns every decision, keeps all state in the store, restartable.

All public methods are thread-safe (one lock). Mutations bump a version and wake agents
waiting in :meth:`Controller.heartbeat`, so orders reach agents at once rather than at the
next beat. :meth:`Controller.step` is the reconcile loop's body: the daemon calls it a few
times a second and whenever something changed; tests call it directly with a fake clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

from trainpod.api.models import (
    AttemptInfo,
    AttemptReport,
    EventInfo,
    Heartbeat,
    JobInfo,
    KillOrder,
    LaunchOrder,
    LaunchPlan,
    NodeInfo,
    Orders,
    RankInfo,
)
from trainpod.clock import Clock, SystemClock
from trainpod.controller import judge as judging
from trainpod.controller.config import ControllerConfig
from trainpod.controller.launch import launch_order
from trainpod.controller.nodes import node_state_after_heartbeat
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
from trainpod.errors import Conflict, NotFound, SpecError
from trainpod.scheduler.fifo import FreeNode, Placement, QueuedJob, place
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.store.rows import AttemptRow, JobRow, NodeRow

log = logging.getLogger(__name__)

_LIVE_NODE_STATES = {NodeState.SETTING_UP, NodeState.IDLE, NodeState.ALLOCATED, NodeState.FAILED}


class Controller:
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

    # -- start-up -------------------------------------------------------------------------
    def bootstrap(self) -> None:
        """Bring the store in line with the spec; give agents a grace period to check in.

        Idempotent: a restarted controller calls it again and loses nothing.
        """
        now = self.clock.now()
        with self._lock, self.store.transaction():
            known = {n.name for n in self.store.nodes()}
            for decl in self.cfg.nodes:
                if decl.name not in known:
                    self.store.insert_node(
                        decl.name, decl.group, decl.role, decl.spare, decl.devices, now
                    )
                    self.store.add_event(now, "node_declared", node=decl.name, group=decl.group)
            restarted = self.store.get_meta("started_at") is not None
            self.store.set_meta("started_at", repr(now))
            self.store.touch_heartbeats(now)
            self.store.add_event(now, "controller_started", restarted=restarted)
            self._bump()

    # -- internals ------------------------------------------------------------------------
    def _bump(self) -> None:
        self._version += 1
        self._changed.notify_all()
        self.wakeup.set()

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

    def _job(self, job_id: int) -> JobRow:
        job = self.store.job(job_id)
        if job is None:
            raise NotFound(f"no job {job_id} on cluster {self.cfg.cluster}; see `trainpod jobs`")
        return job

    # -- jobs -----------------------------------------------------------------------------
    def _resolve(self, spec: JobSpec) -> tuple[JobSpec, str]:
        part = spec.partition or self.cfg.default_partition
        if part not in self.cfg.partitions:
            raise SpecError(
                f"partition {part!r} does not exist on cluster {self.cfg.cluster}; use one of: "
                f"{', '.join(sorted(self.cfg.partitions))}"
            )
        groups = set(self.cfg.partitions[part])
        members = [d for d in self.cfg.nodes if d.group in groups and not d.spare]
        if spec.nodes > len(members):
            spares = sum(1 for d in self.cfg.nodes if d.group in groups and d.spare)
            raise SpecError(
                f"the job asks for {spec.nodes} nodes but partition {part!r} has "
                f"{len(members)} schedulable nodes ({spares} hot spares are held back for "
                f"recovery); ask for --nodes {len(members)} or fewer"
            )
        devices = min((d.devices for d in members), default=0)
        procs = spec.procs_per_node or max(devices, 1)
        if devices and procs > devices:
            raise SpecError(
                f"the job asks for {procs} processes per node but nodes of partition "
                f"{part!r} have {devices} devices; use --procs-per-node {devices} or fewer"
            )
        return spec.model_copy(update={"procs_per_node": procs, "partition": part}), part

    def submit(self, spec: JobSpec) -> int:
        """Queue a job; returns its id. Raises :class:`SpecError` for a job that can never run."""
        resolved, _ = self._resolve(spec)
        now = self.clock.now()
        with self._lock, self.store.transaction():
            job_id = self.store.insert_job(
                resolved.display_name(), resolved.model_dump(mode="json"), now
            )
            self.store.add_event(
                now,
                "job_submitted",
                job_id=job_id,
                nodes=resolved.nodes,
                procs_per_node=resolved.procs_per_node,
                partition=resolved.partition,
                user=resolved.user,
                command=resolved.command,
            )
            self._bump()
        return job_id

    def plan(self, spec: JobSpec) -> LaunchPlan:
        """What :meth:`submit` would launch if the job were placed now (``--dry-run``)."""
        resolved, part = self._resolve(spec)
        procs = resolved.procs_per_node or 1
        with self._lock:
            groups = set(self.cfg.partitions[part])
            pool = [n for n in self._schedulable() if n.group in groups]
            note = ""
            if len(pool) < resolved.nodes:
                note = f"only {len(pool)} nodes are idle now; the job would wait in the queue"
                pool = [n for n in self.store.nodes() if n.group in groups and not n.spare]
            nodes = [n.name for n in pool[: resolved.nodes]]
            addr = self._address(nodes[0])
            orders = {
                name: launch_order(
                    self.cfg,
                    job_id=0,
                    attempt_id=0,
                    spec=resolved,
                    attempt_number=1,
                    nodes=nodes,
                    node_index=i,
                    procs_per_node=procs,
                    master_addr=addr,
                    master_port=0,
                )
                for i, name in enumerate(nodes)
            }
        return LaunchPlan(job=resolved, partition=part, nodes=nodes, orders=orders, note=note)

    def cancel(self, job_id: int) -> JobRow:
        """Ask for a job to end. Idempotent; an ended job raises :class:`Conflict`."""
        now = self.clock.now()
        with self._lock, self.store.transaction():
            job = self._job(job_id)
            if job.state.ended:
                raise Conflict(f"job {job_id} has already ended ({job.state.value})")
            self.store.update_job(job_id, now, cancel_requested=True)
            self.store.add_event(now, "cancel_requested", job_id=job_id)
            if job.state is JobState.QUEUED:
                self._set_job(job, JobState.CANCELLED, now, reason="cancelled while queued")
            else:
                for attempt in self.store.attempts(job_id):
                    self._reconcile(attempt.id, now, {})
            self._bump()
            return self._job(job_id)

    # -- agents ---------------------------------------------------------------------------
    def heartbeat(self, hb: Heartbeat) -> Orders:
        """Record an agent's report and return its orders.

        With ``hb.wait_s > 0`` and orders equal to those the agent holds, the reply waits up
        to ``wait_s`` for them to change (a long poll), so new orders arrive at once.
        """
        with self._lock:
            self._record(hb)
            orders = self._orders_for(hb.node)
            if hb.wait_s > 0 and orders.hash == hb.orders_hash:
                # Real time, like the wait itself: an injected (fake) clock may never move.
                deadline = time.monotonic() + hb.wait_s
                version = self._version
                while orders.hash == hb.orders_hash:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._changed.wait(remaining)
                    if self._version != version:
                        version = self._version
                        orders = self._orders_for(hb.node)
            return orders

    def _record(self, hb: Heartbeat) -> None:
        now = self.clock.now()
        with self.store.transaction():
            node = self.store.node(hb.node)
            if node is None:
                raise NotFound(
                    f"node {hb.node!r} is not part of cluster {self.cfg.cluster}; "
                    "was the agent started for another cluster?"
                )
            new_agent = node.agent_id != hb.agent_id
            if new_agent:
                self.store.add_event(
                    now,
                    "agent_registered",
                    node=node.name,
                    agent_pid=hb.agent_pid,
                    address=hb.address,
                    restarted=node.agent_id is not None,
                )
            elif hb.agent_id not in self._agents_seen:
                self.store.add_event(now, "agent_reconnected", node=node.name)
            self._agents_seen.add(hb.agent_id)
            self.store.update_node(
                node.name,
                now,
                last_heartbeat=now,
                address=hb.address,
                agent_id=hb.agent_id,
                agent_pid=hb.agent_pid,
                facts={**hb.facts, "lifecycle": hb.lifecycle.model_dump()},
            )
            target, reason = node_state_after_heartbeat(node, hb)
            if target is not None and target != node.state:
                self._set_node(node, target, now, reason=reason)
            touched = self._apply_reports(node.name, hb.attempts, now)
            if new_agent:
                touched |= self._lose_unreported(node.name, hb.attempts, now)
            self._agent_running[node.name] = {
                a.attempt_id for a in hb.attempts if any(r.state == "running" for r in a.ranks)
            }
            tails = {r.rank: r.log_tail for a in hb.attempts for r in a.ranks if r.log_tail}
            for attempt_id in touched:
                self._reconcile(attempt_id, now, tails)
            self._bump()

    def _apply_reports(self, node: str, reports: list[AttemptReport], now: float) -> set[int]:
        touched: set[int] = set()
        for rep in reports:
            attempt = self.store.attempt(rep.attempt_id)
            if attempt is None:
                continue
            rows = {r.rank: r for r in self.store.ranks(attempt.id)}
            for rr in rep.ranks:
                row = rows.get(rr.rank)
                if row is None or row.node != node or row.state.ended:
                    continue
                if row.state is RankState.PENDING:
                    self.store.update_rank(
                        attempt.id,
                        rr.rank,
                        state=RankState.RUNNING,
                        pid=rr.pid,
                        started_at=rr.started_at or now,
                    )
                    self.store.add_event(
                        now,
                        "rank_started",
                        node=node,
                        job_id=attempt.job_id,
                        attempt=attempt.number,
                        rank=rr.rank,
                        pid=rr.pid,
                        started_at=rr.started_at,
                    )
                    touched.add(attempt.id)
                if rr.state == "exited":
                    self.store.update_rank(
                        attempt.id,
                        rr.rank,
                        state=RankState.EXITED,
                        exit_code=rr.exit_code,
                        signal=rr.signal,
                        ended_at=rr.ended_at or now,
                    )
                    data: dict[str, Any] = {"exit_code": rr.exit_code, "signal": rr.signal}
                    if rr.exit_code != 0:
                        data["log_tail"] = rr.log_tail
                    self.store.add_event(
                        now,
                        "rank_exited",
                        node=node,
                        job_id=attempt.job_id,
                        attempt=attempt.number,
                        rank=rr.rank,
                        exited_at=rr.ended_at,
                        **data,
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
                    self._lose_rank(attempt, r.rank, node, now, "agent restarted")
                    touched.add(attempt.id)
        return touched

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
        self._after_attempt(job, attempt, verdict, now)

    def _after_attempt(
        self, job: JobRow, attempt: AttemptRow, verdict: judging.Verdict, now: float
    ) -> None:
        """Move the job along with its attempt, and free nodes once an attempt has ended."""
        state = verdict.state
        if state is AttemptState.RUNNING:
            self._set_job(job, JobState.RUNNING, now, started_at=job.started_at or now)
            if job.started_at is None:
                self.store.add_event(now, "job_first_start", job_id=job.id)
        elif state is AttemptState.STOPPING:
            self._set_job(job, JobState.STOPPING, now, reason=self._reason(verdict))
        elif state.ended:
            self._release_nodes(attempt, now)
            if state is AttemptState.SUCCEEDED:
                self._set_job(job, JobState.COMPLETED, now, reason="")
            elif state is AttemptState.CANCELLED:
                self._set_job(job, JobState.CANCELLED, now, reason="cancelled by request")
            else:
                self._set_job(job, JobState.FAILED, now, reason=self._reason(verdict))

    @staticmethod
    def _reason(verdict: judging.Verdict) -> str:
        if verdict.cause == judging.CAUSE_CANCEL:
            return "cancelling"
        text = judging.describe_failure(verdict.failure)
        tail = str(verdict.failure.get("log_tail", "")).strip()
        return f"{text}\n{tail}" if tail else text

    def _release_nodes(self, attempt: AttemptRow, now: float) -> None:
        for name in attempt.nodes:
            node = self.store.node(name)
            if node is None or node.job_id != attempt.job_id:
                continue
            if node.state is NodeState.ALLOCATED:
                self._set_node(node, NodeState.IDLE, now, job_id=None, reason="")
            else:
                self.store.update_node(name, now, job_id=None)
            self.store.add_event(now, "node_released", node=name, job_id=attempt.job_id)

    def _orders_for(self, node: str) -> Orders:
        launch: list[LaunchOrder] = []
        kill: list[KillOrder] = []
        active: set[int] = set()
        for attempt in self.store.active_attempts():
            if node not in attempt.nodes:
                continue
            active.add(attempt.id)
            mine = [r for r in self.store.ranks(attempt.id) if r.node == node]
            if attempt.state is AttemptState.STOPPING:
                if any(not r.state.ended for r in mine):
                    kill.append(
                        KillOrder(
                            attempt_id=attempt.id,
                            grace_s=self.cfg.teardown_grace_s,
                            reason=attempt.cause,
                        )
                    )
            elif any(r.state is RankState.PENDING for r in mine):
                launch.append(self._launch_order(attempt, node))
        for attempt_id in sorted(self._agent_running.get(node, set()) - active):
            kill.append(KillOrder(attempt_id=attempt_id, grace_s=0.0, reason="attempt ended"))
        return Orders(
            launch=launch, kill=kill, heartbeat_interval_s=self.cfg.heartbeat_interval_s
        ).sealed()

    def _launch_order(self, attempt: AttemptRow, node: str) -> LaunchOrder:
        job = self._job(attempt.job_id)
        spec = JobSpec.model_validate(job.spec)
        return launch_order(
            self.cfg,
            job_id=job.id,
            attempt_id=attempt.id,
            spec=spec,
            attempt_number=attempt.number,
            nodes=attempt.nodes,
            node_index=attempt.nodes.index(node),
            procs_per_node=spec.procs_per_node or 1,
            master_addr=attempt.master_addr,
            master_port=attempt.master_port,
        )

    def _address(self, node: str) -> str:
        row = self.store.node(node)
        return (row.address if row else None) or "127.0.0.1"

    def _schedulable(self) -> list[NodeRow]:
        return [
            n
            for n in self.store.nodes()
            if n.state is NodeState.IDLE and not n.spare and n.role == "compute"
        ]

    # -- the reconcile step ---------------------------------------------------------------
    def step(self) -> None:
        """One pass of the control loop: liveness, then placement. Safe to call any time."""
        self.wakeup.clear()
        now = self.clock.now()
        with self._lock, self.store.transaction():
            self._check_liveness(now)
            self._schedule(now)

    def _check_liveness(self, now: float) -> None:
        timeout = self.cfg.heartbeat_timeout_s
        for node in self.store.nodes():
            if node.state not in _LIVE_NODE_STATES or node.last_heartbeat is None:
                continue
            if node.agent_id is None or now - node.last_heartbeat <= timeout:
                continue
            silent = now - node.last_heartbeat
            self._set_node(node, NodeState.SUSPECT, now, reason=f"no heartbeat for {silent:.1f}s")
            for attempt in self.store.active_attempts():
                if node.name not in attempt.nodes:
                    continue
                for r in self.store.ranks(attempt.id):
                    if r.node == node.name and not r.state.ended:
                        self._lose_rank(attempt, r.rank, node.name, now, "node heartbeat lost")
                self._reconcile(attempt.id, now, {})
            self._bump()

    def _schedule(self, now: float) -> None:
        """Place queued jobs (FIFO gangs). Cheap when nothing changed since the last pass."""
        if self._version == self._scheduled_at_version:
            return
        queued = self.store.job_ids([JobState.QUEUED])
        for stale in set(self._queue) - set(queued):
            del self._queue[stale]
        for job_id in queued:
            if job_id not in self._queue:
                spec = JobSpec.model_validate(self._job(job_id).spec)
                part = spec.partition or self.cfg.default_partition
                groups = frozenset(self.cfg.partitions.get(part, []))
                self._queue[job_id] = QueuedJob(id=job_id, nodes=spec.nodes, groups=groups)
        placements: list[Placement] = []
        if queued:
            free = [
                FreeNode(n.name, n.group) for n in sorted(self._schedulable(), key=self._node_order)
            ]
            placements = place([self._queue[j] for j in queued], free)
        for placement in placements:
            self._start_attempt(self._job(placement.job_id), list(placement.nodes), now)
        if placements:
            self._bump()
        self._scheduled_at_version = self._version

    def _start_attempt(self, job: JobRow, nodes: list[str], now: float) -> None:
        spec = JobSpec.model_validate(job.spec)
        number = len(self.store.attempts(job.id)) + 1
        addr = self._address(nodes[0])
        port = self._ports(addr)
        attempt_id = self.store.insert_attempt(
            job.id, number, nodes, addr, port, spec.procs_per_node or 1, now
        )
        for name in nodes:
            node = self.store.node(name)
            assert node is not None
            self._set_node(node, NodeState.ALLOCATED, now, job_id=job.id, reason="")
        self._set_job(job, JobState.STARTING, now)
        self.store.add_event(
            now,
            "attempt_created",
            job_id=job.id,
            attempt=number,
            attempt_id=attempt_id,
            nodes=nodes,
            master_addr=addr,
            master_port=port,
        )

    def _node_order(self, node: NodeRow) -> tuple[int, str]:
        return (self._order.get(node.name, len(self._order)), node.name)

    # -- queries --------------------------------------------------------------------------
    def node_infos(self) -> list[NodeInfo]:
        with self._lock:
            rows = sorted(self.store.nodes(), key=self._node_order)
        return [_node_info(n) for n in rows]

    def job_info(self, job_id: int) -> JobInfo:
        with self._lock:
            return self._job_info(self._job(job_id))

    def job_infos(self, include_ended: bool = True, limit: int | None = None) -> list[JobInfo]:
        with self._lock:
            states = None if include_ended else [s for s in JobState if not s.ended]
            return [self._job_info(j) for j in self.store.jobs(states, limit=limit)]

    def _job_info(self, job: JobRow) -> JobInfo:
        attempts = []
        for a in self.store.attempts(job.id):
            ranks = [
                RankInfo(
                    rank=r.rank,
                    node=r.node,
                    local_rank=r.local_rank,
                    state=r.state.value,
                    pid=r.pid,
                    exit_code=r.exit_code,
                    signal=r.signal,
                    started_at=r.started_at,
                    ended_at=r.ended_at,
                )
                for r in self.store.ranks(a.id)
            ]
            attempts.append(
                AttemptInfo(
                    number=a.number,
                    state=a.state.value,
                    nodes=a.nodes,
                    master_addr=a.master_addr,
                    master_port=a.master_port,
                    created_at=a.created_at,
                    started_at=a.started_at,
                    ended_at=a.ended_at,
                    cause=a.cause,
                    failure=a.failure,
                    ranks=ranks,
                )
            )
        return JobInfo(
            id=job.id,
            name=job.name,
            state=job.state.value,
            reason=job.reason,
            spec=JobSpec.model_validate(job.spec),
            submitted_at=job.submitted_at,
            started_at=job.started_at,
            ended_at=job.ended_at,
            attempts=attempts,
        )

    def event_infos(
        self,
        *,
        job_id: int | None = None,
        node: str | None = None,
        after: int = 0,
        limit: int | None = None,
    ) -> list[EventInfo]:
        with self._lock:
            rows = self.store.events(job_id=job_id, node=node, after=after, limit=limit)
        return [EventInfo(**vars(e)) for e in rows]

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            nodes = Counter(n.state.value for n in self.store.nodes())
            jobs = Counter(j.state.value for j in self.store.jobs())
        return dict(nodes), dict(jobs)


def _node_info(n: NodeRow) -> NodeInfo:
    return NodeInfo(
        name=n.name,
        group=n.group,
        role=n.role,
        spare=n.spare,
        devices=n.devices,
        state=n.state.value,
        reason=n.reason,
        job_id=n.job_id,
        address=n.address,
        agent_pid=n.agent_pid,
        last_heartbeat=n.last_heartbeat,
        facts=n.facts,
    )
