"""The controller: owns every decision, keeps all state in the store, restartable.

All public methods are thread-safe (one lock). Mutations bump a version and wake agents
waiting in :meth:`Controller.heartbeat`, so orders reach agents at once rather than at the
next beat. :meth:`Controller.step` is the reconcile loop's body: the daemon calls it a few
times a second and whenever something changed; tests call it directly with a fake clock.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from typing import Any

from trainpod.api.models import (
    AttemptInfo,
    AttemptReport,
    ChaosOrder,
    ChaosRequest,
    DeepCheckOrder,
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
from trainpod.controller import checkpoints, progress
from trainpod.controller.launch import launch_order
from trainpod.controller.nodes import node_state_after_heartbeat
from trainpod.controller.policy import FaultKind
from trainpod.controller.recovery import RecoveryMixin
from trainpod.controller.states import AttemptState, JobState, NodeState, RankState
from trainpod.errors import Conflict, NotFound, SpecError
from trainpod.scheduler.fifo import FreeNode, Placement, QueuedJob, place
from trainpod.spec.job import JobSpec
from trainpod.store.rows import AttemptRow, JobRow, NodeRow

log = logging.getLogger(__name__)

_LIVE_NODE_STATES = {NodeState.SETTING_UP, NodeState.IDLE, NodeState.ALLOCATED, NodeState.FAILED}
_FAULT_FREE = {NodeState.QUARANTINED, NodeState.REPAIRING, NodeState.RETIRED, NodeState.STOPPED}
_NEEDS_RANK = {"kill-worker", "hang", "slow"}


class Controller(RecoveryMixin):
    # -- start-up -------------------------------------------------------------------------
    def bootstrap(self) -> None:
        """Bring the store in line with the spec; give agents a grace period to check in.

        Idempotent: a restarted controller calls it again and loses nothing.
        """
        now = self.clock.now()
        with self._lock, self.store.transaction():
            known = {n.name for n in self.store.nodes()}
            # Slurm nodes appear when an allocation's agent first registers.
            for decl in [] if self.external else self.cfg.nodes:
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

    # -- jobs -----------------------------------------------------------------------------
    def _resolve(self, spec: JobSpec) -> tuple[JobSpec, str]:
        part = spec.partition or self.cfg.default_partition
        if part not in self.cfg.partitions:
            raise SpecError(
                f"partition {part!r} does not exist on cluster {self.cfg.cluster}; use one of: "
                f"{', '.join(sorted(self.cfg.partitions))}"
            )
        slurm_only = spec.slurm_only()
        if slurm_only and not self.external:
            raise SpecError(
                f"{', '.join(slurm_only)} only apply on a Slurm cluster; cluster "
                f"{self.cfg.cluster} uses the {self.cfg.backend} backend (its hot spares are "
                "the spec's spare groups); remove them"
            )
        groups = set(self.cfg.partitions[part])
        members = [d for d in self.cfg.nodes if d.group in groups and not d.spare]
        if self.external and members and spec.nodes + spec.spares > len(members):
            raise SpecError(
                f"the job asks for {spec.nodes} nodes + {spec.spares} spares but partition "
                f"{part!r} has {len(members)} nodes; ask for fewer"
            )
        if spec.nodes > len(members) and not self.external:
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
                auto_resume=resolved.auto_resume,
            )
            if self.external:
                self._submit_external(job_id, resolved, now)
            self._bump()
        return job_id

    def plan(self, spec: JobSpec) -> LaunchPlan:
        """What :meth:`submit` would launch if the job were placed now (``--dry-run``)."""
        resolved, part = self._resolve(spec)
        procs = resolved.procs_per_node or 1
        if self.external:
            note = (
                f"Slurm places the job: {resolved.nodes} node(s)"
                + (f" + {resolved.spares} spare(s)" if resolved.spares else "")
                + f" in partition {part!r}; job id 0 stands for the id it will get"
            )
            script = self.ops.render(0, resolved)
            return LaunchPlan(
                job=resolved, partition=part, nodes=[], orders={}, note=note, batch_script=script
            )
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
            if self.external and job.external:
                self._ops_call("cancel", now, self.ops.cancel, job.external, job_id=job_id)
            if job.state is JobState.QUEUED:
                self._set_job(job, JobState.CANCELLED, now, reason="cancelled while queued")
            elif job.state is JobState.RECOVERING and self._active_attempt(job_id) is None:
                self._release_nodes(job_id, self._held_nodes(job_id), now)
                self._set_job(job, JobState.CANCELLED, now, reason="cancelled while recovering")
            else:
                for attempt in self.store.attempts(job_id):
                    self._reconcile(attempt.id, now, {})
            self._bump()
            return self._job(job_id)

    # -- chaos ----------------------------------------------------------------------------
    def chaos(self, req: ChaosRequest) -> ChaosOrder:
        """Queue a fault for a node's agent to inject through a real mechanism."""
        now = self.clock.now()
        with self._lock, self.store.transaction():
            node = self._node(req.node)
            if node.agent_id is None or node.state in (NodeState.STOPPED, NodeState.RETIRED):
                raise Conflict(f"{node.name} has no running agent to inject {req.fault} with")
            rank = req.rank
            if req.fault in _NEEDS_RANK:
                running = self._running_ranks(node.name)
                if not running:
                    raise Conflict(f"{req.fault} needs a running rank on {node.name}; none is")
                if rank is None:
                    rank = running[0]
                elif rank not in running:
                    raise Conflict(f"rank {rank} is not running on {node.name}: {running}")
            order = ChaosOrder(id=uuid.uuid4().hex[:12], fault=req.fault, rank=rank)
            self._chaos.setdefault(node.name, []).append(order)
            self.store.add_event(
                now,
                "chaos_injected",
                node=node.name,
                job_id=node.job_id,
                fault=req.fault,
                rank=rank,
                id=order.id,
            )
            self._bump()
            return order

    def _running_ranks(self, node: str) -> list[int]:
        return [
            r.rank
            for a in self.store.active_attempts()
            if node in a.nodes
            for r in self.store.ranks(a.id)
            if r.node == node and r.state is RankState.RUNNING
        ]

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
            return orders.model_copy(update={"controller_time": self.clock.now()})

    def _record(self, hb: Heartbeat) -> None:
        now = self.clock.now()
        with self.store.transaction():
            node = self.store.node(hb.node)
            if node is None and self.external and hb.allocation is not None:
                node = self._declare_external(hb, now)
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
                # Chaos orders were for the old instance (a kill-agent order must not kill its
                # replacement): a new agent starts with none.
                self._chaos.pop(node.name, None)
            elif hb.agent_id not in self._agents_seen:
                self.store.add_event(now, "agent_reconnected", node=node.name)
            self._agents_seen.add(hb.agent_id)
            facts = {
                **hb.facts,
                "lifecycle": hb.lifecycle.model_dump(),
                "health": [h.model_dump() for h in hb.health],
            }
            self.store.update_node(
                node.name,
                now,
                last_heartbeat=now,
                address=hb.address,
                agent_id=hb.agent_id,
                agent_pid=hb.agent_pid,
                facts=facts,
            )
            if self.external:
                stale = self._stale_allocation(hb.allocation, hb.allocation_round)
                if stale:
                    self._stale_agents.add(hb.agent_id)
                alloc = None if hb.leaving or stale else hb.allocation
                owner = self.store.job(alloc) if alloc is not None else None
                if owner is not None and not owner.external and hb.external_id:
                    self.store.update_job(owner.id, now, external=hb.external_id)  # salloc
                if alloc != node.allocation:
                    self.store.update_node(node.name, now, allocation=alloc)
                    if alloc is not None:
                        self.store.add_event(now, "node_allocated", node=node.name, job_id=alloc)
                    node = self._node(node.name)
            if node.state is NodeState.REPAIRING:
                self._repair_on_heartbeat(node, hb, now)
            else:
                target, reason = node_state_after_heartbeat(node, hb)
                if target is not None and target != node.state:
                    self._set_node(node, target, now, reason=reason)
            self._record_beacons(hb, now)
            self._checkpoints.record(self.store, hb, now)
            touched = self._apply_reports(node.name, hb.attempts, now)
            if new_agent:
                touched |= self._lose_unreported(node.name, hb.attempts, now)
            self._agent_running[node.name] = {
                a.attempt_id for a in hb.attempts if any(r.state == "running" for r in a.ranks)
            }
            tails = {r.rank: r.log_tail for a in hb.attempts for r in a.ranks if r.log_tail}
            for attempt_id in touched:
                self._reconcile(attempt_id, now, tails)
            self._apply_health(self._node(node.name), hb, now)
            if hb.chaos_done and node.name in self._chaos:
                done = set(hb.chaos_done)
                self._chaos[node.name] = [c for c in self._chaos[node.name] if c.id not in done]
            self._bump()

    def _apply_health(self, node: NodeRow, hb: Heartbeat, now: float) -> None:
        """A FAULT from any health check quarantines the node (and stops its attempt)."""
        if node.state in _FAULT_FREE or hb.leaving:
            return
        faults = [h for h in hb.health if h.status == "fault"]
        if not faults:
            return
        first = faults[0]
        kind = FaultKind.GPU_FAULT if first.check == "gpu" else FaultKind.NODE_FAULT
        reason = "; ".join(f"{h.check}: {h.reason}" for h in faults)
        self._quarantine(node, reason, kind, now, repair=self.cfg.auto_repair)

    def _record_beacons(self, hb: Heartbeat, now: float) -> None:
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
            book = self._beacons.setdefault(attempt.id, {})
            for b in beacons:
                book[b.rank] = (b, now)
            if attempt.id in self._first_beacon_logged:
                continue
            self._first_beacon_logged.add(attempt.id)
            if not self.store.has_event(attempt.job_id, "first_beacon", attempt.number):
                first = min(beacons, key=lambda b: b.first_at)
                self.store.add_event(
                    now,
                    "first_beacon",
                    node=hb.node,
                    job_id=attempt.job_id,
                    attempt=attempt.number,
                    at=first.first_at,
                    step=first.first_step,
                    rank=first.rank,
                )

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
        deep = None
        row = self.store.node(node)
        if row is not None and row.state is NodeState.REPAIRING and row.repair.get("deep_check_id"):
            deep = DeepCheckOrder(
                id=row.repair["deep_check_id"], timeout_s=self.cfg.deep_check_timeout_s
            )
        return Orders(
            launch=launch,
            kill=kill,
            deep_check=deep,
            chaos=list(self._chaos.get(node, [])),
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            active_jobs=checkpoints.active_jobs(self.store, node),
            leave=self._leave_code(row),
        ).sealed()

    def _leave_code(self, row: NodeRow | None) -> int | None:
        """Slurm: an allocation agent whose job ended (or was requeued) exits with this."""
        if not self.external or row is None:
            return None
        if row.agent_id in self._stale_agents:
            return 1
        if row.allocation is None:
            return None
        job = self.store.job(row.allocation)
        if job is None or not job.state.ended:
            return None
        return 0 if job.state is JobState.COMPLETED else 1

    def _declare_external(self, hb: Heartbeat, now: float) -> NodeRow:
        """A Slurm node seen for the first time: its agent says which group it serves."""
        group = hb.group or next(iter(self.cfg.partitions.values()))[0]
        self.store.insert_node(hb.node, group, "compute", False, hb.devices or 0, now)
        self.store.add_event(now, "node_declared", node=hb.node, group=group)
        self._order.setdefault(hb.node, len(self._order))
        return self._node(hb.node)

    def _observed_mtbf(self, attempt: AttemptRow) -> dict[str, str]:
        """The job's mean time between failures as this cluster has seen it, for a
        Checkpointer's ``interval="auto"`` (Young/Daly): node-seconds observed per fault,
        divided by the job's nodes. Nothing before the first fault (the library's default
        applies). Fixed per attempt, so its orders do not change under it."""
        cached = self._mtbf.get(attempt.id)
        if cached is None:
            faults, first = self.store.fault_history()
            cached = {}
            if faults and first is not None:
                node_s = (self.clock.now() - first) * max(1, len(self.store.nodes()))
                per_job = node_s / faults / max(1, len(attempt.nodes))
                cached = {
                    "TRAINPOD_MTBF_S": f"{max(per_job, 1.0):.0f}",
                    "TRAINPOD_MTBF_SOURCE": (
                        f"cluster {self.cfg.cluster}: {faults} faults in "
                        f"{node_s / 3600:.2f} node-hours, job of {len(attempt.nodes)} nodes"
                    ),
                }
            self._mtbf[attempt.id] = cached
        return cached

    def _launch_order(self, attempt: AttemptRow, node: str) -> LaunchOrder:
        job = self._job(attempt.job_id)
        spec = self._spec(job)
        if "TRAINPOD_MTBF_S" not in spec.env and (mtbf := self._observed_mtbf(attempt)):
            spec = spec.model_copy(update={"env": {**mtbf, **spec.env}})
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
            restart_reason=attempt.restart_reason,
        )

    # -- the reconcile step ---------------------------------------------------------------
    def step(self) -> None:
        """One pass of the control loop: liveness, progress, repair, recovery, placement."""
        self.wakeup.clear()
        now = self.clock.now()
        with self._lock, self.store.transaction():
            self._check_liveness(now)
            self._check_progress(now)
            self._repair_step(now)
            self._retry_waiting(now)
            self._schedule(now)

    def _check_liveness(self, now: float) -> None:
        timeout = self.cfg.heartbeat_timeout_s
        for node in self.store.nodes():
            if node.last_heartbeat is None or node.agent_id is None:
                continue
            if now - node.last_heartbeat <= timeout:
                continue
            if node.state not in _LIVE_NODE_STATES:
                # Already taken out (quarantined: Slurm saw it DOWN first), but its agent has
                # gone silent too: its ranks are lost, or their attempt would wait forever.
                self._lose_silent_ranks(node.name, now)
                continue
            if self._allocation_gone(node, now):
                continue
            silent = now - node.last_heartbeat
            reason = f"node lost: no heartbeat for {silent:.1f}s"
            self._set_node(node, NodeState.SUSPECT, now, reason=reason)
            for attempt in self.store.active_attempts():
                if node.name not in attempt.nodes:
                    continue
                for r in self.store.ranks(attempt.id):
                    if r.node == node.name and not r.state.ended:
                        self._lose_rank(attempt, r.rank, node.name, now, "node heartbeat lost")
                self._reconcile(attempt.id, now, {})
            self._quarantine(
                self._node(node.name),
                reason,
                FaultKind.NODE_LOST,
                now,
                repair=self.cfg.auto_repair,
                fault_at=node.last_heartbeat,
            )
            self._bump()

    def _lose_silent_ranks(self, node: str, now: float) -> None:
        for attempt in self.store.active_attempts():
            if node not in attempt.nodes:
                continue
            lost = False
            for r in self.store.ranks(attempt.id):
                if r.node == node and not r.state.ended:
                    self._lose_rank(attempt, r.rank, node, now, "node heartbeat lost")
                    lost = True
            if lost:
                self._reconcile(attempt.id, now, {})
                self._bump()

    def _check_progress(self, now: float) -> None:
        """Hangs (no beacon for hang_timeout_s) and persistent stragglers."""
        for attempt in self.store.active_attempts():
            if attempt.state is not AttemptState.RUNNING:
                continue
            job = self._job(attempt.job_id)
            spec = self._spec(job)
            book = self._beacons.get(attempt.id, {})
            # Ranks that exited (0: any other exit stops the attempt) stopped beaconing on
            # purpose; only the running ones can hang or straggle.
            live = {r.rank for r in self.store.ranks(attempt.id) if not r.state.ended}
            beacons = {rank: entry for rank, entry in book.items() if rank in live}
            if book and not beacons:
                continue  # every rank that beaconed is done; the rest never did
            startup = spec.startup_timeout_s
            if (
                startup is not None
                and not book
                and self.store.has_event(job.id, "first_beacon", attempt.number)
            ):
                startup = None  # beacons flowed before this controller (re)started
            hung = progress.hang(
                beacons,
                now=now,
                started_at=attempt.started_at or now,
                hang_timeout_s=spec.hang_timeout_s or self.cfg.hang_timeout_s,
                startup_timeout_s=startup,
            )
            if hung is not None:
                reason, fault_at, rank = hung
                where = {r.rank: r.node for r in self.store.ranks(attempt.id)}.get(rank or -1)
                failure = {
                    "reason": reason,
                    "fault_at": fault_at,
                    "rank": rank,
                    "node": where,
                    "nodes": [where] if where else [],
                }
                self._stop_attempt(attempt, FaultKind.HANG.value, failure, now)
                self._bump()
                continue
            for rank in progress.stragglers(
                self._straggling,
                attempt.id,
                beacons,
                factor=self.cfg.straggler_factor,
                checks=self.cfg.straggler_checks,
            ):
                self._on_straggler(attempt, spec, rank, beacons, now)

    def _on_straggler(
        self, attempt: AttemptRow, spec: JobSpec, rank: int, beacons: Any, now: float
    ) -> None:
        ranks = {r.rank: r for r in self.store.ranks(attempt.id)}
        node = self._node(ranks[rank].node)
        b = beacons.get(rank)
        step_time = b[0].step_time_s if b else None
        self.store.add_event(
            now,
            "straggler_detected",
            node=node.name,
            job_id=attempt.job_id,
            attempt=attempt.number,
            rank=rank,
            step_time_s=step_time,
        )
        groups = self.cfg.partitions.get(spec.partition or self.cfg.default_partition, [])
        spare = any(v.free and v.healthy and v.group in groups for v in self._node_views())
        if spec.auto_resume and spare:
            reason = f"straggler: rank {rank} is persistently slower than its peers"
            self._quarantine(node, reason, FaultKind.STRAGGLER, now, repair=self.cfg.auto_repair)
            self._bump()

    def _schedule(self, now: float) -> None:
        """Place queued jobs (FIFO gangs). Cheap when nothing changed since the last pass."""
        if self._version == self._scheduled_at_version:
            return
        if self.external:
            if self._schedule_allocations(now):
                self._bump()
            self._scheduled_at_version = self._version
            return
        queued = self.store.job_ids([JobState.QUEUED])
        for stale in set(self._queue) - set(queued):
            del self._queue[stale]
        for job_id in queued:
            if job_id not in self._queue:
                spec = self._spec(self._job(job_id))
                part = spec.partition or self.cfg.default_partition
                groups = frozenset(self.cfg.partitions.get(part, []))
                self._queue[job_id] = QueuedJob(id=job_id, nodes=spec.nodes, groups=groups)
        placements: list[Placement] = []
        if queued:
            free = [FreeNode(n.name, n.group) for n in self._schedulable()]
            placements = place([self._queue[j] for j in queued], free)
        for placement in placements:
            self._start_attempt(self._job(placement.job_id), list(placement.nodes), now)
        if placements:
            self._bump()
        self._scheduled_at_version = self._version

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
            spec=self._spec(job),
            submitted_at=job.submitted_at,
            started_at=job.started_at,
            ended_at=job.ended_at,
            attempts=attempts,
            external=job.external,
            progress=self._live_progress(job.id),
        )

    def _live_progress(self, job_id: int) -> dict[str, Any] | None:
        attempt = self._active_attempt(job_id)
        uploads = self._checkpoints.progress(job_id)
        if attempt is None or (attempt.id not in self._beacons and not uploads):
            return None
        out = {"attempt": attempt.number, **progress.summarise(self._beacons.get(attempt.id, {}))}
        return {**out, "checkpoint_uploads": uploads} if uploads else out

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
        drained=n.drained,
        repairs=n.repairs,
        allocation=n.allocation,
    )
