"""The in-process rung of the recovery ladder (ADR 0026): keep the attempt, re-form its group.

:func:`decide_rung` is pure: for a running attempt of a job with ``recovery: in-process``
whose ranks just failed it says whether they are started again in the same attempt
(:class:`RecoverInProcess`) or the fault goes down today's path, a full restart
(:class:`FallBack`, with the reason). :class:`InProcessRung` applies what it says to the
store, for the :class:`~trainpod.controller.executor.Executor`, which alone stops attempts.

A lost node (its agent silent, its ranks ``lost``) is replaced in the attempt by a free
node of the job's groups, hot spares first (ADR 0035): the node's ranks move there and
start fresh in the new generation, taking their state from a healthy peer.

"Confirmed" is: every rank of the attempt beaconed that it joined the new generation
(ADR 0035; ``generation`` in its beacons). A rank that cannot re-join within the deadline
exits with 75, and that exit ends the attempt the old way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from trainpod.api.models import RankBeacon
from trainpod.controller.books import BeaconBook
from trainpod.controller.config import ControllerConfig
from trainpod.controller.judge import describe_failure, first_failure
from trainpod.controller.transitions import HEALTHY_NODE_STATES, Transitions
from trainpod.elastic.protocol import EXIT_RECOVERY_FAILED
from trainpod.model.events import (
    InProcessRecoveryAbandoned,
    InProcessRecoveryDone,
    InProcessRecoveryStarted,
    RankStarted,
)
from trainpod.model.failures import Failure
from trainpod.model.recovery import InProcess
from trainpod.model.states import AttemptState, NodeState, RankState
from trainpod.store.repo import Store
from trainpod.store.rows import AttemptRow, RankRow

CAUSE_IN_PROCESS = "in_process"
"""The goodput cause of the time an in-process recovery took."""


@dataclass(frozen=True)
class RecoverInProcess:
    generation: int
    rank: int  # the rank that failed first
    replaced: tuple[int, ...]
    reason: str
    moves: tuple[tuple[str, str], ...] = ()  # lost node -> the node its ranks move to
    fault_at: float | None = None  # when it went wrong, where no failed rank says (a hang)


@dataclass(frozen=True)
class FallBack:
    reason: str


@dataclass(frozen=True)
class WaitForPeers:
    """A hang not yet told apart: the healthy ranks have not said (yet) that they lost their
    group; they will once their collective timeout runs out."""

    until_s: float  # the hang's age after which it falls back


RungDecision = RecoverInProcess | FallBack

HANG_GRACE_S = 3.0
"""After the longest collective timeout its ranks report, how long a hang waits for them to
say they lost their group (their beacon's way through the agent's heartbeat included)."""
SETTLE_S = 0.5
"""How long after the first rank said it lost its group the others have to say so too (the
teardown's failure spreads through the ring in milliseconds; the beacons ride on each
node's next heartbeat, hence ``heartbeat_interval_s`` on top)."""


def decide_rung(
    *,
    opted_in: bool,
    attempt: AttemptRow,
    ranks: Sequence[RankRow],
    healthy_nodes: frozenset[str],
    restarts_left: int,
    cancel_requested: bool,
    free_nodes: Sequence[str] = (),
    tails: Mapping[int, str] | None = None,
) -> RungDecision | None:
    """The rung's call for ``attempt``; None: not this rung's business (not opted in, not
    running, no new failure, or a recovery still being formed with nothing new).

    ``free_nodes``: where a lost node's ranks may move, in order of preference (hot spares
    first); ``tails``: the failed ranks' last log lines (a rank that exits 75 says why)."""
    if not opted_in or cancel_requested or attempt.state is not AttemptState.RUNNING:
        return None
    ip = attempt.in_process
    pending = set(ip.replaced) if ip.pending else set()
    failed = [r for r in ranks if r.failed and r.rank not in pending]
    if not failed:
        return None
    first = min(failed, key=lambda r: (r.ended_at or float("inf"), r.rank))
    what = describe_failure(first_failure([first], {}) or Failure())
    gave_up = [r for r in failed if r.exit_code == EXIT_RECOVERY_FAILED]
    if gave_up:  # before "a second fault": its own words say why (e.g. state not replicated)
        said = _last_line((tails or {}).get(gave_up[0].rank, ""))
        why = f"; it said: {said}" if said else ""
        return FallBack(f"{what} ({EXIT_RECOVERY_FAILED}: it could not re-join its group){why}")
    if ip.pending:
        return FallBack(f"a second fault while generation {ip.generation} was being formed: {what}")
    lost = sorted({r.node for r in failed if r.state is RankState.LOST})
    spare = [n for n in free_nodes if n not in attempt.nodes]
    if len(spare) < len(lost):
        return FallBack(f"{what}: no free node to start its ranks on in process")
    moves = tuple(zip(lost, spare, strict=False))
    sick = sorted({r.node for r in failed} - healthy_nodes - set(lost))
    if sick:
        return FallBack(f"{what}, and {', '.join(sick)} is not healthy")
    if restarts_left <= 0:
        return FallBack(f"{what}; no restarts left (max_restarts)")
    # A lost node's every rank starts fresh on its replacement, failed or not yet seen so.
    replaced = tuple(sorted({r.rank for r in failed} | {r.rank for r in ranks if r.node in lost}))
    return RecoverInProcess(ip.generation + 1, first.rank, replaced, what, moves)


def decide_hang(
    *,
    attempt: AttemptRow,
    ranks: Sequence[RankRow],
    beacons: Mapping[int, tuple[RankBeacon, float]],
    hung_rank: int | None,
    reason: str,
    fault_at: float,
    now: float,
    healthy_nodes: frozenset[str],
    restarts_left: int,
    settle_s: float = SETTLE_S,
    heard: Mapping[str, float | None] | None = None,
) -> RecoverInProcess | FallBack | WaitForPeers:
    """A running opted-in attempt whose progress stopped (the hang watchdog's ``reason``),
    or some of whose ranks said they lost their group: replace, in process, the ranks that
    stayed silent while the others said so (``lost_generation`` in their beacons, sent once
    their collective failed or timed out); wait while the others may still say so; else
    fall back to a full restart.

    ``beacons``: rank -> (summary, controller time it arrived). ``heard``: node -> when its
    agent's last heartbeat arrived. A silent rank whose agent has not been heard from since
    the first rank said it lost its group may be on a lost node: that is the liveness
    watchdog's to declare (its ranks then move to a free node), so the rung waits."""
    g = attempt.in_process.generation
    live = [r for r in ranks if not r.state.ended]

    def age(rank: int) -> float:
        b, received = beacons[rank]
        return b.age_s + (now - received)

    waiting = {
        r.rank
        for r in live
        if r.rank in beacons
        and (lost := beacons[r.rank][0].lost_generation) is not None
        and lost >= g
    }
    silent_for = now - fault_at
    if not waiting:
        timeouts = [
            t for r in live if r.rank in beacons and (t := beacons[r.rank][0].collective_timeout_s)
        ]
        if not timeouts:
            return FallBack(f"{reason}; its ranks report no collective timeout to wait for")
        until = max(timeouts) + HANG_GRACE_S
        if silent_for <= until:
            return WaitForPeers(until)
        return FallBack(
            f"{reason}; no rank said it lost its group within {until:g} s (its collective "
            "timeout and a grace): the whole job is stuck"
        )
    if max(age(r) for r in waiting) < settle_s:
        return WaitForPeers(silent_for + settle_s)  # the other nodes' heartbeats may follow
    silent = tuple(sorted(r.rank for r in live if r.rank not in waiting))
    first_lost = min(beacons[r][1] - beacons[r][0].age_s for r in waiting)
    quiet = {r.node for r in live if r.rank in silent}
    if heard is not None and any((heard.get(n) or 0.0) <= first_lost for n in quiet):
        return WaitForPeers(silent_for + settle_s)
    sick = sorted(quiet - healthy_nodes)
    if sick:
        return FallBack(f"{reason}, and {', '.join(sick)} is not healthy")
    if restarts_left <= 0:
        return FallBack(f"{reason}; no restarts left (max_restarts)")
    first = hung_rank if hung_rank in silent else (silent[0] if silent else min(waiting))
    names = ", ".join(map(str, silent))
    what = (
        f"{reason}; rank {names} stayed silent while the others lost their group"
        if silent
        else f"{reason}; every rank lost its group, none is stuck"
    )
    return RecoverInProcess(g + 1, first, silent, what, fault_at=fault_at)


def _last_line(tail: str) -> str:
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


@dataclass
class InProcessRung:
    store: Store
    cfg: ControllerConfig
    tx: Transitions
    beacons: BeaconBook
    free_nodes: Callable[[int], list[str]]
    """For a job: the free healthy nodes its ranks may move to, hot spares first."""

    def recovering(
        self,
        attempt: AttemptRow,
        ranks: Sequence[RankRow],
        restarts_left: int,
        now: float,
        tails: Mapping[int, str] | None = None,
    ) -> frozenset[int]:
        """Apply the rung to ``attempt`` (a rank report or a stop just touched it); the ranks
        the judge must treat as still running (the ones being started again)."""
        job = self.tx.job(attempt.job_id)
        healthy = frozenset(n.name for n in self.store.nodes() if n.state in HEALTHY_NODE_STATES)
        lost = any(r.state is RankState.LOST for r in ranks)
        decision = decide_rung(
            opted_in=self.tx.spec(job).recovery == "in-process",
            attempt=attempt,
            ranks=ranks,
            healthy_nodes=healthy,
            restarts_left=restarts_left,
            cancel_requested=job.cancel_requested,
            free_nodes=self.free_nodes(job.id) if lost else (),
            tails=tails,
        )
        ip = attempt.in_process
        if isinstance(decision, FallBack):
            self.abandon(attempt, decision.reason, now)
            return frozenset()
        if isinstance(decision, RecoverInProcess):
            return self._start(attempt, ranks, decision, now)
        return frozenset(ip.replaced) if ip.pending else frozenset()

    def would_move(self, attempt: AttemptRow, node: str, restarts_left: int, now: float) -> bool:
        """Would the rung move ``node``'s ranks to a free node in the same attempt, were
        they lost? (A node taken out of service while its agent lives: a GPU fault, a
        failed check, a straggler.) Asked before any of them is lost, so that a node the
        rung would not replace in process is stopped the old way, with its own fault."""
        job = self.tx.job(attempt.job_id)
        if self.tx.spec(job).recovery != "in-process":
            return False
        ranks = [
            replace(r, state=RankState.LOST, ended_at=now)
            if r.node == node and not r.state.ended
            else r
            for r in self.store.ranks(attempt.id)
        ]
        healthy = frozenset(n.name for n in self.store.nodes() if n.state in HEALTHY_NODE_STATES)
        decision = decide_rung(
            opted_in=True,
            attempt=attempt,
            ranks=ranks,
            healthy_nodes=healthy,
            restarts_left=restarts_left,
            cancel_requested=job.cancel_requested,
            free_nodes=self.free_nodes(job.id),
        )
        return isinstance(decision, RecoverInProcess) and bool(decision.moves)

    def hung(
        self,
        attempt: AttemptRow,
        beacons: Mapping[int, tuple[RankBeacon, float]],
        hung_rank: int | None,
        reason: str,
        fault_at: float,
        restarts_left: int,
        now: float,
    ) -> bool:
        """The hang watchdog found ``attempt`` (of an opted-in job) stuck: True while the
        rung handles it (a recovery started, or waiting to tell the stuck ranks apart);
        False: it goes the old way (the reason is in an event)."""
        ranks = self.store.ranks(attempt.id)
        nodes = self.store.nodes()
        healthy = frozenset(n.name for n in nodes if n.state in HEALTHY_NODE_STATES)
        decision = decide_hang(
            attempt=attempt,
            ranks=ranks,
            beacons=beacons,
            hung_rank=hung_rank,
            reason=reason,
            fault_at=fault_at,
            now=now,
            healthy_nodes=healthy,
            restarts_left=restarts_left,
            settle_s=SETTLE_S + self.cfg.heartbeat_interval_s,
            heard={n.name: n.last_heartbeat for n in nodes},
        )
        if isinstance(decision, WaitForPeers):
            return True
        if isinstance(decision, FallBack):
            self.abandon(attempt, decision.reason, now)
            return False
        self._start(attempt, ranks, decision, now)
        return True

    def _start(
        self, attempt: AttemptRow, ranks: Sequence[RankRow], d: RecoverInProcess, now: float
    ) -> frozenset[int]:
        fault_at = d.fault_at
        if fault_at is None:
            fault_at = min((r.ended_at or now) for r in ranks if r.failed and r.rank in d.replaced)
        node = next(r.node for r in ranks if r.rank == d.rank)
        nodes = self._move(attempt, ranks, dict(d.moves), now) if d.moves else attempt.nodes
        addr = self.tx.address(nodes[0])  # rank 0's node hosts the new store
        port = self.tx.new_port(addr)
        deadline = self.cfg.in_process_deadline_s
        ip = InProcess(
            generation=d.generation,
            master_port=port,
            master_addr=addr,
            replaced=d.replaced,
            fault_rank=d.rank,
            fault_at=fault_at,
            started_at=now,
            deadline_at=now + deadline,
            pending=True,
        )
        self.store.update_attempt(attempt.id, in_process=ip.to_json())
        self.store.append(
            now,
            InProcessRecoveryStarted(
                job_id=attempt.job_id,
                attempt=attempt.number,
                node=node,
                generation=d.generation,
                rank=d.rank,
                replaced=d.replaced,
                master_port=port,
                deadline_s=deadline,
                reason=d.reason,
                moved=dict(d.moves) or None,
            ),
        )
        self.tx.wake.bump()
        return frozenset(d.replaced)

    def _move(
        self, attempt: AttemptRow, ranks: Sequence[RankRow], moves: dict[str, str], now: float
    ) -> list[str]:
        """A lost node's place in the attempt goes to its replacement (same index, so the
        same ranks): the node is allocated to the job, the lost one let go, and its ranks
        wait there to be started fresh (``pending``: the replacement's launch order)."""
        for lost, new in moves.items():
            self.tx.set_node(self.tx.node(new), NodeState.ALLOCATED, now, job_id=attempt.job_id)
            self.tx.release_nodes(attempt.job_id, [lost], now)
            for r in ranks:
                if r.node == lost:
                    self.store.update_rank(
                        attempt.id,
                        r.rank,
                        node=new,
                        state=RankState.PENDING,
                        pid=None,
                        exit_code=None,
                        signal=None,
                        started_at=None,
                        ended_at=None,
                    )
        nodes = [moves.get(n, n) for n in attempt.nodes]
        self.store.update_attempt(attempt.id, nodes=nodes)
        return nodes

    def abandon(self, attempt: AttemptRow, reason: str, now: float) -> None:
        """Give an opted-in attempt's recovery up (or say why none is tried): the fault
        goes the old way."""
        ip = attempt.in_process
        if self.tx.spec(self.tx.job(attempt.job_id)).recovery != "in-process":
            return
        if ip.pending:
            self.store.update_attempt(attempt.id, in_process=replace(ip, pending=False).to_json())
        self.store.append(
            now,
            InProcessRecoveryAbandoned(
                job_id=attempt.job_id,
                attempt=attempt.number,
                generation=ip.generation if ip.pending else 0,
                reason=reason,
            ),
        )

    def restarted(
        self,
        attempt: AttemptRow,
        row: RankRow,
        pid: int | None,
        started_at: float | None,
        now: float,
    ) -> bool:
        """A replaced rank runs again (its agent's report): its row goes back to running
        with the new process; True if so. The recovery is done once every rank beacons the
        new generation (:meth:`confirm`)."""
        ip = attempt.in_process
        if not ip.pending or row.rank not in ip.replaced or attempt.state.ended:
            return False
        if attempt.state is AttemptState.STOPPING:
            return False
        self.store.update_rank(
            attempt.id,
            row.rank,
            state=RankState.RUNNING,
            pid=pid,
            started_at=started_at or now,
            exit_code=None,
            signal=None,
            ended_at=None,
        )
        self.store.append(
            now,
            RankStarted(
                node=row.node,
                job_id=attempt.job_id,
                attempt=attempt.number,
                rank=row.rank,
                pid=pid,
                started_at=started_at,
            ),
        )
        fresh = self.store.attempt(attempt.id)
        if fresh is not None:
            self.confirm(fresh, now)  # its beacon of the generation may have come first
        return True

    def unconfirmed(self, attempt: AttemptRow) -> list[int]:
        """The ranks that have not beaconed the attempt's newest generation yet, or (a
        replaced one) are not recorded as running again: a beacon can arrive in the same
        heartbeat as, and be read before, the report of the rank's new process."""
        book = self.beacons.of(attempt.id)
        g = attempt.in_process.generation
        return [
            r.rank
            for r in self.store.ranks(attempt.id)
            if r.rank not in book
            or book[r.rank][0].generation < g
            or r.state is not RankState.RUNNING
        ]

    def confirm(self, attempt: AttemptRow, now: float) -> bool:
        """A pending generation that every rank beaconed is done; True if so."""
        ip = attempt.in_process
        if not ip.pending or attempt.state is not AttemptState.RUNNING:
            return False
        if self.unconfirmed(attempt):
            return False
        self.store.update_attempt(attempt.id, in_process=replace(ip, pending=False).to_json())
        self.store.append(
            now,
            InProcessRecoveryDone(
                job_id=attempt.job_id,
                attempt=attempt.number,
                generation=ip.generation,
                rank=ip.fault_rank if ip.fault_rank is not None else -1,
                duration_s=max(0.0, now - (ip.fault_at or ip.started_at or now)),
            ),
        )
        return True

    def overdue(self, now: float) -> list[tuple[AttemptRow, Failure]]:
        """Attempts whose recovery passed its deadline: given up here; the executor stops
        each with the failure returned."""
        out: list[tuple[AttemptRow, Failure]] = []
        for attempt in self.store.active_attempts():
            ip = attempt.in_process
            if attempt.state is not AttemptState.RUNNING:
                continue  # stopping already (cancelled): nothing to give up
            if not ip.pending or ip.deadline_at is None or now < ip.deadline_at:
                continue
            rows = self.store.ranks(attempt.id)
            waiting = [
                r for r in rows if r.rank in ip.replaced and r.state is not RankState.RUNNING
            ]
            limit = f"{self.cfg.in_process_deadline_s:g} s"
            if waiting:
                names = ", ".join(str(r.rank) for r in waiting)
                why = f"generation {ip.generation}: rank {names} not running again within {limit}"
            else:
                names = ", ".join(str(r) for r in self.unconfirmed(attempt)) or "?"
                why = (
                    f"generation {ip.generation}: rank {names} did not confirm joining it "
                    f"(beacon) within {limit}"
                )
                waiting = [r for r in rows if r.rank in ip.replaced]
            self.abandon(attempt, why, now)
            first = first_failure(waiting, {}) or Failure()
            out.append((attempt, replace(first, reason=why, fault_at=ip.fault_at)))
        return out
