"""What each node's agent must do now: launches, kills, a deep check, chaos, leave."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from trainpod.api.models import DeepCheckOrder, KillOrder, LaunchOrder, Orders, RecoverOrder
from trainpod.clock import Clock
from trainpod.controller import checkpoints
from trainpod.controller.books import ChaosBook
from trainpod.controller.config import ControllerConfig
from trainpod.controller.external import Scheduling
from trainpod.controller.judge import CAUSE_PREEMPTED
from trainpod.controller.launch import launch_order
from trainpod.controller.transitions import Transitions
from trainpod.elastic import protocol as elastic_protocol
from trainpod.model.states import AttemptState, NodeState, RankState
from trainpod.store.repo import Store
from trainpod.store.rows import AttemptRow, NodeRow, RankRow


@dataclass
class _Shared:
    """What every node's orders are made from, as read at ``version`` (the store's
    ``work_version``)."""

    version: int
    attempts: list[AttemptRow]  # the active ones
    live: dict[str, list[int]]  # node -> jobs not ended that ran there (checkpoints stay)
    ranks: dict[int, list[RankRow]] = field(default_factory=dict)  # read when first needed
    by_node: dict[str, list[AttemptRow]] = field(default_factory=dict)  # node -> its attempts
    idle: dict[tuple[tuple[int, ...], int | None], Orders] = field(
        default_factory=dict
    )  # (live jobs, leave code) -> the orders of a node with nothing to do

    def __post_init__(self) -> None:
        for attempt in self.attempts:
            for node in dict.fromkeys(attempt.nodes):
                self.by_node.setdefault(node, []).append(attempt)


@dataclass
class OrderDesk:
    store: Store
    cfg: ControllerConfig
    tx: Transitions
    scheduling: Scheduling
    chaos: ChaosBook
    running: dict[str, set[int]]  # node -> attempts its agent last reported live ranks of
    clock: Clock
    _mtbf: dict[int, dict[str, str]] = field(
        default_factory=dict, init=False
    )  # attempt -> MTBF env
    _shared: _Shared | None = field(default=None, init=False)

    def for_node(self, node: str) -> Orders:
        return self.for_nodes([node])[0]

    def for_nodes(self, nodes: Sequence[str]) -> list[Orders]:
        """Each node's orders. What they share (the active attempts and their ranks, the
        live jobs by node) is read once and kept while no job, attempt or rank is written
        (``Store.work_version``): every beat of every agent asks for its orders, and a
        change wakes every parked long poll to look again."""
        shared = self._shared
        if shared is None or shared.version != self.store.work_version:
            shared = self._shared = _Shared(
                self.store.work_version,
                self.store.active_attempts(),
                checkpoints.active_jobs_by_node(self.store),
            )
        return [self._orders(node, shared) for node in nodes]

    def _orders(self, node: str, shared: _Shared) -> Orders:
        attempts = shared.by_node.get(node, [])
        row = self.store.node(node)
        if not attempts and not self.running.get(node):
            idle = self._idle(node, row, shared)
            if idle is not None:
                return idle
        launch: list[LaunchOrder] = []
        kill: list[KillOrder] = []
        recover: list[RecoverOrder] = []
        stores: list[int] = []  # the attempts whose store this node's agent hosts (ADR 0028)
        active: set[int] = set()
        for attempt in attempts:
            active.add(attempt.id)
            if attempt.nodes[0] == node:
                stores.append(attempt.id)
            if attempt.id not in shared.ranks:
                shared.ranks[attempt.id] = self.store.ranks(attempt.id)
            mine = [r for r in shared.ranks[attempt.id] if r.node == node]
            if attempt.state is AttemptState.STOPPING:
                if any(not r.state.ended for r in mine):
                    kill.append(self.kill_order(attempt))
            else:
                if any(r.state is RankState.PENDING for r in mine):
                    launch.append(self.launch_order(attempt, node))
                if attempt.in_process.generation > 0:
                    recover.append(self.recover_order(attempt, shared.ranks[attempt.id], mine))
        for attempt_id in sorted(self.running.get(node, set()) - active):
            kill.append(KillOrder(attempt_id=attempt_id, grace_s=0.0, reason="attempt ended"))
        deep = None
        check_id = row.repair.deep_check_id if row is not None else None
        if row is not None and row.state is NodeState.REPAIRING and check_id:
            deep = DeepCheckOrder(id=check_id, timeout_s=self.cfg.deep_check_timeout_s)
        return Orders(
            launch=launch,
            kill=kill,
            recover=recover,
            deep_check=deep,
            chaos=self.chaos.pending(node),
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            active_jobs=shared.live.get(node, []),
            leave=self.scheduling.leave_code(row),
            stores=stores,
        ).sealed()

    def _idle(self, node: str, row: NodeRow | None, shared: _Shared) -> Orders | None:
        """The orders of a node with no attempt, no live ranks, no chaos and no deep check
        (most nodes, most of the time): made once per version for all such nodes alike,
        so a look-up of a thousand parked polls' orders after a change costs little."""
        if self.chaos.pending(node) or (row is not None and row.state is NodeState.REPAIRING):
            return None
        key = (tuple(shared.live.get(node, [])), self.scheduling.leave_code(row))
        kept = shared.idle.get(key)
        if kept is None:
            kept = shared.idle[key] = Orders(
                heartbeat_interval_s=self.cfg.heartbeat_interval_s,
                active_jobs=list(key[0]),
                leave=key[1],
            ).sealed()
        return kept

    def kill_order(self, attempt: AttemptRow) -> KillOrder:
        """A stopping attempt's kill order; a preempted one's carries the notice (its signal,
        and the grace the preemption gave, else the spec's ``preemption.grace_s``)."""
        teardown = self.cfg.teardown_grace_s
        if attempt.cause != CAUSE_PREEMPTED:
            grace = attempt.failure.grace_s
            return KillOrder(
                attempt_id=attempt.id,
                grace_s=teardown if grace is None else grace,
                reason=attempt.cause,
            )
        notice = attempt.failure.grace_s
        return KillOrder(
            attempt_id=attempt.id,
            grace_s=teardown,
            reason=attempt.cause,
            notice_signal=self.cfg.preemption.signal,
            notice_grace_s=self.cfg.preemption.grace_s if notice is None else notice,
        )

    def recover_order(
        self, attempt: AttemptRow, ranks: Sequence[RankRow], mine: Sequence[RankRow]
    ) -> RecoverOrder:
        """The newest generation of an attempt recovered in process (ADR 0026), for every
        node of it (the agent acts on a generation once); ``respawn``: this node's replaced
        ranks."""
        ip = attempt.in_process
        assert ip.master_port is not None
        return RecoverOrder(
            attempt_id=attempt.id,
            generation=ip.generation,
            master_addr=ip.master_addr or attempt.master_addr,
            master_port=ip.master_port,
            world_size=len(ranks),
            replaced=list(ip.replaced),
            respawn=[r.rank for r in mine if r.rank in ip.replaced],
            deadline_s=self.cfg.in_process_deadline_s,
        )

    def launch_order(self, attempt: AttemptRow, node: str) -> LaunchOrder:
        job = self.tx.job(attempt.job_id)
        spec = self.tx.spec(job)
        if "TRAINPOD_MTBF_S" not in spec.env and (mtbf := self._observed_mtbf(attempt)):
            spec = spec.model_copy(update={"env": {**mtbf, **spec.env}})
        if spec.secret_env:  # the values, kept apart: for the ranks' env only (ADR 0032)
            spec = spec.model_copy(update={"env": {**spec.env, **self.tx.secrets.get(job.id)}})
        order = launch_order(
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
        ip = attempt.in_process
        if ip.generation > 0 and ip.master_port is not None:
            # A lost node's ranks start on their replacement into the newest generation
            # (ADR 0035): its store, and the generation they join taking a peer's state.
            order.env.update(
                {
                    "MASTER_ADDR": ip.master_addr or attempt.master_addr,
                    "MASTER_PORT": str(ip.master_port),
                    elastic_protocol.ENV_GENERATION: str(ip.generation),
                }
            )
        return order

    def keep_only(self, attempt_ids: set[int]) -> None:
        """Evict what was kept for attempts that have ended."""
        for stale in set(self._mtbf) - attempt_ids:
            del self._mtbf[stale]

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
