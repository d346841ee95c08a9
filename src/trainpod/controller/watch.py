"""The reconcile loop's watchdogs: silent nodes, hung jobs and persistent stragglers."""

from __future__ import annotations

from dataclasses import dataclass

from trainpod.controller import judge as judging
from trainpod.controller import progress
from trainpod.controller.books import BeaconBook
from trainpod.controller.config import ControllerConfig
from trainpod.controller.executor import Executor
from trainpod.controller.external import Scheduling
from trainpod.controller.policy import FaultKind
from trainpod.controller.progress import Book
from trainpod.controller.transitions import Transitions
from trainpod.model.events import RanksLeftIdle, StragglerDetected
from trainpod.model.failures import Failure
from trainpod.model.states import AttemptState, NodeState
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.store.rows import AttemptRow, RankRow

_LIVE_NODE_STATES = {NodeState.SETTING_UP, NodeState.IDLE, NodeState.ALLOCATED, NodeState.FAILED}


@dataclass
class Watchdog:
    store: Store
    cfg: ControllerConfig
    tx: Transitions
    scheduling: Scheduling
    executor: Executor
    beacons: BeaconBook

    # -- liveness -----------------------------------------------------------------------------
    def liveness(self, now: float) -> None:
        """A node whose agent went silent for heartbeat_timeout_s is lost with its ranks."""
        timeout = self.cfg.heartbeat_timeout_s
        for node in self.store.silent_nodes(now - timeout):
            if node.last_heartbeat is None or node.agent_id is None:
                continue
            if now - node.last_heartbeat <= timeout:
                continue
            if node.state not in _LIVE_NODE_STATES:
                # Already taken out (quarantined: Slurm saw it DOWN first), but its agent has
                # gone silent too: its ranks are lost, or their attempt would wait forever.
                self._lose_silent_ranks(node.name, now)
                continue
            if self.scheduling.allocation_gone(node, now):
                continue
            silent = now - node.last_heartbeat
            reason = f"node lost: no heartbeat for {silent:.1f}s"
            self.tx.set_node(node, NodeState.SUSPECT, now, reason=reason)
            for attempt in self.store.active_attempts():
                if node.name not in attempt.nodes:
                    continue
                for r in self.store.ranks(attempt.id):
                    if r.node == node.name and not r.state.ended:
                        self.tx.lose_rank(attempt, r.rank, node.name, now, "node heartbeat lost")
                self.executor.reconcile(attempt.id, now, {})
            self.executor.quarantine(
                self.tx.node(node.name),
                reason,
                FaultKind.NODE_LOST,
                now,
                repair=self.cfg.auto_repair,
                fault_at=node.last_heartbeat,
            )
            self.tx.wake.bump()

    def _lose_silent_ranks(self, node: str, now: float) -> None:
        for attempt in self.store.active_attempts():
            if node not in attempt.nodes:
                continue
            lost = False
            for r in self.store.ranks(attempt.id):
                if r.node == node and not r.state.ended:
                    self.tx.lose_rank(attempt, r.rank, node, now, "node heartbeat lost")
                    lost = True
            if lost:
                self.executor.reconcile(attempt.id, now, {})
                self.tx.wake.bump()

    # -- progress -----------------------------------------------------------------------------
    def _past_time_limit(self, attempt: AttemptRow, spec: JobSpec, now: float) -> bool:
        """Stop an attempt that has run past the job's --time (as Slurm's TIMEOUT)."""
        limit = spec.time_limit_s()
        started = attempt.started_at
        if limit is None or started is None or not self.scheduling.enforces_time_limits:
            return False
        if spec.interactive:
            return False  # an allocation's --time ends its lease (controller/allocations.py)
        if now - started < limit:
            return False
        reason = f"time limit {spec.time_limit} reached (ran {now - started:.0f}s)"
        failure = Failure(reason=reason, nodes=tuple(attempt.nodes))
        self.executor.stop_attempt(attempt, judging.CAUSE_TIME_LIMIT, failure, now)
        self.tx.wake.bump()
        return True

    def progress(self, now: float) -> None:
        """Hangs (no beacon for hang_timeout_s) and persistent stragglers."""
        for attempt in self.store.active_attempts():
            if attempt.state is not AttemptState.RUNNING:
                continue
            job = self.tx.job(attempt.job_id)
            spec = self.tx.spec(job)
            if self._past_time_limit(attempt, spec, now):
                continue
            if attempt.in_process.pending:
                # Its group is being re-formed in process: no rank steps until every one has
                # joined, and the rung's own deadline gives that up (ADR 0035), not a hang.
                continue
            ranks = self.store.ranks(attempt.id)
            if self._left_idle(attempt, ranks, now):
                continue
            book = self.beacons.of(attempt.id)
            # Ranks that exited (0: any other exit stops the attempt) stopped beaconing on
            # purpose; only the running ones can hang or straggle.
            live = {r.rank for r in ranks if not r.state.ended}
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
            if hung is None and spec.recovery == "in-process":
                # its ranks say so before any hang timeout: the collective's is shorter
                hung = progress.group_lost(
                    beacons, generation=attempt.in_process.generation, now=now
                )
            if hung is not None:
                reason, fault_at, rank = hung
                if spec.recovery == "in-process" and self.executor.hang_in_process(
                    attempt, book, rank, reason, fault_at, now
                ):
                    continue  # its stuck ranks are replaced in process (ADR 0026 addendum)
                where = {r.rank: r.node for r in ranks}.get(rank) if rank is not None else None
                failure = Failure(
                    reason=reason,
                    fault_at=fault_at,
                    rank=rank,
                    node=where,
                    nodes=(where,) if where else (),
                    nulls=frozenset({"rank", "node"}),  # written even when not known
                )
                self.executor.stop_attempt(attempt, FaultKind.HANG.value, failure, now)
                self.tx.wake.bump()
                continue
            for rank in progress.stragglers(
                self.beacons.straggling,
                attempt.id,
                beacons,
                factor=self.cfg.straggler_factor,
                checks=self.cfg.straggler_checks,
            ):
                self._straggler(attempt, spec, rank, beacons, now)

    def _left_idle(self, attempt: AttemptRow, ranks: list[RankRow], now: float) -> bool:
        """Stop an attempt whose ranks stay running, idle, after every other rank exited 0
        (stuck in their teardown, ADR 0049): it ends a success once they are torn down."""
        wait = self.cfg.exit_wait_s
        idle = self.beacons.idle_since.get(attempt.id, {})
        stuck = judging.left_idle(ranks, idle, now, wait)
        if not stuck:
            return False
        nodes = tuple(sorted({r.node for r in ranks if r.rank in stuck}))
        self.store.append(
            now,
            RanksLeftIdle(
                job_id=attempt.job_id,
                attempt=attempt.number,
                ranks=stuck,
                nodes=nodes,
                waited_s=wait,
            ),
        )
        failure = Failure(reason=judging.describe_left_idle(stuck, ranks, wait), nodes=nodes)
        self.executor.stop_attempt(attempt, judging.CAUSE_LEFT_IDLE, failure, now)
        self.tx.wake.bump()
        return True

    def _straggler(
        self,
        attempt: AttemptRow,
        spec: JobSpec,
        rank: int,
        beacons: Book,
        now: float,
    ) -> None:
        ranks = {r.rank: r for r in self.store.ranks(attempt.id)}
        node = self.tx.node(ranks[rank].node)
        b = beacons.get(rank)
        self.store.append(
            now,
            StragglerDetected(
                node=node.name,
                job_id=attempt.job_id,
                attempt=attempt.number,
                rank=rank,
                step_time_s=b[0].step_time_s if b else None,
            ),
        )
        groups = self.cfg.partitions.get(spec.partition or self.cfg.default_partition, [])
        spare = any(v.free and v.healthy and v.group in groups for v in self.executor.node_views())
        if spec.auto_resume and spare:
            reason = f"straggler: rank {rank} is persistently slower than its peers"
            self.executor.quarantine(
                node, reason, FaultKind.STRAGGLER, now, repair=self.cfg.auto_repair
            )
            self.tx.wake.bump()
