"""The controller: owns every decision, keeps all state in the store, restartable.

A thin composition: :class:`Controller` owns the lock, the store, the clock and
:meth:`Controller.step`, and delegates to collaborators that get what they need in their
constructors (see docs/decisions/0011-composed-controller.md for the diagram):

* :class:`~trainpod.controller.transitions.Transitions` — checked state changes + events;
* :class:`~trainpod.controller.intake.HeartbeatIngest` — one agent's report, step by step;
* :class:`~trainpod.controller.executor.Executor` — applies the recovery ladder's and the
  scheduler's decisions;
* :class:`~trainpod.controller.watch.Watchdog` — silent nodes, hangs, stragglers;
* :class:`~trainpod.controller.repair.NodeRepair` — replace or check, deep check, retire;
* :class:`~trainpod.controller.external.Scheduling` — who places jobs (trainpod or Slurm),
  with the :class:`~trainpod.scheduler.base.Scheduler` it plans with;
* :class:`~trainpod.controller.orders.OrderDesk` and :class:`~trainpod.controller.views.Views`;
* :class:`~trainpod.controller.allocations.Allocations` — ``trainpod alloc``'s leases,
  shells and ``trainpod run``'s steps.

All public methods are thread-safe (one lock). Mutations bump a version and wake agents
waiting in a heartbeat long poll, so orders reach agents at once rather than at the next
beat. :meth:`step` is the reconcile loop's body: the daemon calls it a few times a second
and whenever something changed; tests call it directly with a fake clock.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from trainpod.api.devices import DeviceTelemetry
from trainpod.api.models import (
    AllocationLease,
    ChaosOrder,
    ChaosRequest,
    EventInfo,
    Heartbeat,
    JobInfo,
    LaunchPlan,
    NodeAction,
    NodeInfo,
    Orders,
    ShellContext,
    StepPlan,
    StepRequest,
)
from trainpod.clock import Clock, SystemClock
from trainpod.controller.access import Access, Action, Principal, owned_by
from trainpod.controller.admission import Admission
from trainpod.controller.allocations import Allocations
from trainpod.controller.books import BeaconBook, ChaosBook
from trainpod.controller.checkpoints import CheckpointEvents
from trainpod.controller.config import ControllerConfig
from trainpod.controller.energy import EnergyViews
from trainpod.controller.executor import Executor
from trainpod.controller.external import Scheduling
from trainpod.controller.history import ProgressPoint
from trainpod.controller.intake import HeartbeatIngest
from trainpod.controller.metrics import ClusterMetrics
from trainpod.controller.operators import Operators
from trainpod.controller.ops import Observed
from trainpod.controller.orders import OrderDesk
from trainpod.controller.planning import Planner
from trainpod.controller.policy import FaultKind
from trainpod.controller.ports import PortAllocator, free_port
from trainpod.controller.repair import NodeRepair, Replacer
from trainpod.controller.telemetry import TelemetryBook
from trainpod.controller.transitions import Transitions
from trainpod.controller.views import Views
from trainpod.controller.wake import Wake
from trainpod.controller.watch import Watchdog
from trainpod.errors import Conflict
from trainpod.model.events import (
    CancelRequested,
    ChaosInjected,
    ControllerStarted,
    ControllerStepFailed,
    ControllerStepRecovered,
    JobHeld,
    JobReleased,
    JobSubmitted,
    NodeDeclared,
)
from trainpod.model.states import AttemptState, JobState, NodeState, RankState
from trainpod.scheduler.base import Preempt
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.store.rows import JobRow, NodeRow

log = logging.getLogger(__name__)

SchedulingFactory = Callable[[Store, ControllerConfig, Transitions], Scheduling]
_NEEDS_RANK = {"kill-worker", "hang", "slow"}
_LIVE_JOB_STATES = [s for s in JobState if not s.ended]


class Controller:
    def __init__(
        self,
        store: Store,
        config: ControllerConfig,
        *,
        clock: Clock | None = None,
        ports: PortAllocator = free_port,
        scheduling: SchedulingFactory = Scheduling,
        replacer: Replacer | None = None,
    ) -> None:
        self.store = store
        self.cfg = config
        self.clock = clock or SystemClock()
        self.started_at = self.clock.now()
        self._lock = threading.RLock()
        self.wake = Wake(self._lock)
        self.wakeup = self.wake.step_due  # set when step() has work to do
        self.tx = Transitions(store, config, self.wake, ports)
        self.scheduling = scheduling(store, config, self.tx)
        self.beacons = BeaconBook()
        self.chaos_book = ChaosBook()
        self.checkpoints = CheckpointEvents()
        self.telemetry = TelemetryBook(store)
        self.executor = Executor(store, config, self.tx, self.scheduling, self.beacons)
        self.repair = NodeRepair(store, config, self.tx, self.scheduling, replacer)
        self.intake = HeartbeatIngest(
            store,
            config,
            self.tx,
            self.scheduling,
            self.executor,
            self.repair,
            self.beacons,
            self.chaos_book,
            self.checkpoints,
            self.telemetry,
        )
        self.watchdog = Watchdog(
            store, config, self.tx, self.scheduling, self.executor, self.beacons
        )
        self.orders = OrderDesk(
            store,
            config,
            self.tx,
            self.scheduling,
            self.chaos_book,
            self.intake.running,
            self.clock,
        )
        self.views = Views(
            store,
            self.tx,
            self._lock,
            self.beacons,
            self.checkpoints,
            lambda: self.executor.holds,
            self.clock.now,
        )
        self.admission = Admission(config, self.tx, self.scheduling)
        self.access = Access(store, self.clock, self._lock)
        self.planner = Planner(store, config, self.tx, self.scheduling, self.executor)
        self.energy = EnergyViews(store, config, self.tx, self._lock, self.telemetry)
        self.metrics = ClusterMetrics(
            store,
            config,
            self._lock,
            self.views,
            self.beacons,
            self.telemetry,
            self.planner,
            self.clock.now,
        )
        self.operators = Operators(store, self.tx, self.scheduling, self.executor, self.repair)
        self.allocations = Allocations(
            store, config, self.tx, ports, leases=self.scheduling.leases_allocations
        )

    # -- start-up -------------------------------------------------------------------------
    def bootstrap(self) -> None:
        """Bring the store in line with the spec; give agents a grace period to check in.

        Idempotent: a restarted controller calls it again and loses nothing.
        """
        now = self.clock.now()
        with self._lock, self.store.transaction():
            known = {n.name for n in self.store.nodes()}
            declared = self.cfg.nodes if self.scheduling.declares_nodes else []
            for decl in declared:
                if decl.name not in known:
                    self.store.insert_node(
                        decl.name, decl.group, decl.role, decl.spare, decl.devices, now
                    )
                    self.store.append(now, NodeDeclared(node=decl.name, group=decl.group))
            restarted = self.store.get_meta("started_at") is not None
            self.store.set_meta("started_at", repr(now))
            self.store.touch_heartbeats(now)
            self.allocations.adopt(now)
            self.store.append(now, ControllerStarted(restarted=restarted))
            self.access.seed(self.cfg.users)
            self.wake.bump()

    # -- jobs -----------------------------------------------------------------------------
    def submit(self, spec: JobSpec, by: Principal | None = None) -> int:
        """Queue a job; returns its id. Raises :class:`SpecError` for a job that can never run.

        ``by``: the caller, who becomes the owner whatever ``spec.user`` says (the API
        always passes it; None: trusted in-process callers such as tests)."""
        if by is not None:
            spec = spec.model_copy(update=owned_by(by))
        resolved = self.admission.resolve(spec)
        now = self.clock.now()
        with self._lock, self.store.transaction():
            job_id = self.store.insert_job(
                resolved.display_name(), resolved.model_dump(mode="json"), now
            )
            self.store.append(
                now,
                JobSubmitted(
                    job_id=job_id,
                    nodes=resolved.nodes,
                    procs_per_node=resolved.procs_per_node,
                    partition=resolved.partition,
                    user=resolved.user,
                    command=tuple(resolved.command),
                    auto_resume=resolved.auto_resume,
                ),
            )
            self.scheduling.submitted(job_id, resolved, now)
            self.allocations.submitted(job_id, resolved, now)
            self.wake.bump()
        return job_id

    def plan(self, spec: JobSpec, by: Principal | None = None) -> LaunchPlan:
        """What :meth:`submit` would launch if the job were placed now (``--dry-run``)."""
        if by is not None:
            spec = spec.model_copy(update=owned_by(by))
        with self._lock:
            return self.admission.plan(spec)

    def cancel(self, job_id: int, by: Principal | None = None) -> JobRow:
        """Ask for a job to end. Idempotent; an ended job raises :class:`Conflict`; a caller
        who is neither its owner nor an admin, :class:`~trainpod.errors.Forbidden`."""
        if by is not None:
            self.authorize(by, Action.CANCEL, job_id)
        now = self.clock.now()
        with self._lock, self.store.transaction():
            job = self.tx.job(job_id)
            if job.state.ended:
                raise Conflict(f"job {job_id} has already ended ({job.state.value})")
            self.store.update_job(job_id, now, cancel_requested=True)
            self.store.append(now, CancelRequested(job_id=job_id))
            self.scheduling.cancelled(job, now)
            if job.state in (JobState.QUEUED, JobState.PREEMPTED):
                self.tx.set_job(job, JobState.CANCELLED, now, reason="cancelled while queued")
            elif job.state is JobState.RECOVERING and self.tx.active_attempt(job_id) is None:
                self.tx.release_all(job_id, now)
                self.tx.set_job(job, JobState.CANCELLED, now, reason="cancelled while recovering")
            else:
                for attempt in self.store.attempts(job_id):
                    self.executor.reconcile(attempt.id, now, {})
            self.wake.bump()
            return self.tx.job(job_id)

    # -- interactive allocations (trainpod alloc, shell, run) -----------------------------
    def renew_allocation(self, job_id: int) -> AllocationLease:
        """The allocation's CLI is still there: renew its lease."""
        with self._lock:
            return self.allocations.renew(job_id, self.clock.now())

    def release_allocation(self, job_id: int, reason: str) -> JobRow:
        """The allocation's CLI gives it back (its shell exited): the job is cancelled."""
        now = self.clock.now()
        with self._lock, self.store.transaction():
            job = self.allocations.release(job_id, reason, now)
            return job if job.state.ended else self.cancel(job_id)

    def shell_context(
        self, node: str | None, job_id: int | None, by: Principal | None = None
    ) -> ShellContext:
        """A shell's context; it runs as the caller's POSIX account, if they have one."""
        with self._lock:
            ctx = self.allocations.shell(node, job_id)
        return ctx if by is None else ctx.model_copy(update={"account": by.account})

    def job_on(self, node: str) -> int | None:
        """The job a node is held by now, if any (a node's shell is a shell in it)."""
        with self._lock:
            return self.tx.node(node).job_id

    def start_step(self, job_id: int, req: StepRequest) -> StepPlan:
        """``trainpod run`` inside an allocation: launch orders on its nodes, not queued."""
        now = self.clock.now()
        with self._lock, self.store.transaction():
            return self.allocations.step(job_id, req, now)

    def end_step(self, job_id: int, step: int, exit_code: int) -> None:
        now = self.clock.now()
        with self._lock, self.store.transaction():
            self.allocations.step_ended(job_id, step, exit_code, now)

    def hold(self, job_id: int, by: Principal, release: bool = False) -> JobRow:
        """Keep a waiting job in the queue, never placed, until released (Slurm's
        ``scontrol hold``); its owner's or an admin's. Holding a held job, or releasing one
        that is not, changes nothing; a job that is not waiting raises :class:`Conflict`."""
        self.authorize(by, Action.HOLD, job_id)
        now = self.clock.now()
        with self._lock, self.store.transaction():
            job = self.tx.job(job_id)
            if job.state not in (JobState.QUEUED, JobState.PREEMPTED):
                what = "released" if release else "held"
                raise Conflict(
                    f"job {job_id} is {job.state.value}: only a waiting job can be {what}"
                )
            if release and job.held_by:
                self.store.update_job(job_id, now, held_by="")
                self.store.append(now, JobReleased(job_id=job_id, by=by.name))
            elif not release and not job.held_by:
                self.store.update_job(job_id, now, held_by=by.name)
                self.store.append(now, JobHeld(job_id=job_id, by=by.name))
            self.wake.bump()
            return self.tx.job(job_id)

    def authorize(self, by: Principal, action: Action, job_id: int | None = None) -> None:
        """Return if ``by`` may do ``action`` (on the job); else record the refusal and
        raise :class:`~trainpod.errors.Forbidden` (see :mod:`trainpod.controller.access`)."""
        with self._lock:
            job = self.tx.job(job_id) if job_id is not None else None
        self.access.authorize(by, action, job)

    def preempt(self, job_id: int, reason: str = "", grace_s: float | None = None) -> JobRow:
        """Preempt a running job by hand (an admin's), as a scheduler's ``Preempt`` would:
        its ranks get the notice and ``grace_s`` (default: the spec's ``preemption.grace_s``),
        then it waits in the queue as ``preempted``. A job with nothing running raises
        :class:`Conflict`."""
        now = self.clock.now()
        why = reason.strip() or "preempted by an administrator"
        with self._lock, self.store.transaction():
            job = self.tx.job(job_id)
            attempt = self.tx.active_attempt(job_id)
            if job.state.ended or attempt is None:
                raise Conflict(
                    f"job {job_id} is {job.state.value}, with no attempt running: "
                    "only a running job can be preempted"
                )
            if job.cancel_requested or attempt.state is AttemptState.STOPPING:
                raise Conflict(f"job {job_id} is already stopping ({job.reason or 'cancel'})")
            grace = self.cfg.preemption.grace_s if grace_s is None else grace_s
            self.executor.preempt(Preempt(job_id, why, grace), now)
            self.wake.bump()
            return self.tx.job(job_id)

    # -- chaos ----------------------------------------------------------------------------
    def chaos(self, req: ChaosRequest) -> ChaosOrder:
        """Queue a fault for a node's agent to inject through a real mechanism."""
        now = self.clock.now()
        with self._lock, self.store.transaction():
            node = self.tx.node(req.node)
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
            self.chaos_book.add(node.name, order)
            self.store.append(
                now,
                ChaosInjected(
                    node=node.name,
                    job_id=node.job_id,
                    fault=req.fault,
                    rank=rank,
                    order_id=order.id,
                ),
            )
            self.wake.bump()
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
    def beat(self, hb: Heartbeat) -> tuple[Orders, int]:
        """Record an agent's report; its orders now and the version they were made at.

        A report that gave nodes back (an attempt ended) runs the scheduling pass at once,
        here: the next job is placed before this reply is sent, so the reporting node gets
        its launch order in the reply and the others' parked polls are woken with theirs,
        without waiting for the reconcile loop to come round."""
        with self._lock:
            before, freed = self.store.appended, self.tx.released
            now = self.clock.now()
            with self.store.transaction():
                self.intake.apply(hb, now)
            if self.store.appended != before:
                # Something happened (every change writes an event): wake the loop and the
                # parked polls. A beat that only says "still here" wakes nobody, or a
                # thousand agents would each wake the thousand others every second.
                self.wake.bump()
            if self.tx.released != freed:
                self._schedule_now(now)
            return self.orders.for_node(hb.node), self.wake.version

    def _schedule_now(self, now: float) -> None:
        """What :meth:`step` does with freed nodes, now: jobs in recovery that wait for
        nodes first (as in the step), then a scheduling pass. One that fails leaves the
        report recorded: the reconcile loop (woken by the bump) tries again and keeps the
        failure's count and backoff. Inside a batch of beats (:meth:`serve`) the pass joins
        the batch's transaction: its savepoint undoes a failed pass's writes and keeps the
        beat's."""
        try:
            with self.store.transaction(), self.store.savepoint():
                self.executor.retry_waiting(now)
                self._schedule(now)
        except Exception:
            log.exception("the scheduling pass after a node was freed failed; the loop retries")

    def orders_for(self, node: str) -> tuple[Orders, int]:
        with self._lock:
            return self.orders.for_node(node), self.wake.version

    def serve(self, work: Sequence[Heartbeat | str]) -> list[tuple[Orders, int] | Exception]:
        """Beats (a :class:`Heartbeat`: :meth:`beat`) and order look-ups (a node's name:
        :meth:`orders_for`) under one hold of the lock; a reply for each, in order. The
        API's heartbeat thread hands over every beat that arrived meanwhile, instead of
        queueing each on the lock behind the reconcile step. They are committed together
        (one SQLite transaction, a savepoint each: a beat that fails leaves no trace, the
        others stay), before any is answered. An item's error is its reply."""
        done: dict[int, tuple[Orders, int] | Exception] = {}
        with self._lock, self.store.transaction():
            for i, w in enumerate(work):
                if isinstance(w, Heartbeat):
                    try:
                        with self.store.savepoint():
                            done[i] = self.beat(w)
                    except Exception as exc:  # that call's error (its reply), not the others'
                        done[i] = exc
            # The look-ups after every beat (the freshest orders), together: all at one
            # version, what nodes' orders share read once.
            looked_up = [i for i, w in enumerate(work) if not isinstance(w, Heartbeat)]
            if looked_up:
                try:
                    found = self.orders.for_nodes([str(work[i]) for i in looked_up])
                    done.update(
                        (i, (o, self.wake.version)) for i, o in zip(looked_up, found, strict=True)
                    )
                except Exception as exc:
                    done.update((i, exc) for i in looked_up)
        return [done[i] for i in range(len(work))]

    def stamp(self, orders: Orders) -> Orders:
        return orders.model_copy(update={"controller_time": self.clock.now()})

    def heartbeat(self, hb: Heartbeat) -> Orders:
        """Record an agent's report and return its orders (for threads; the API uses the
        async long poll in :mod:`trainpod.api.app`, which holds no thread while it waits).

        With ``hb.wait_s > 0`` and orders equal to those the agent holds, the reply waits up
        to ``wait_s`` for them to change (a long poll), so new orders arrive at once.
        """
        with self._lock:
            orders, version = self.beat(hb)
            # Real time, like the wait itself: an injected (fake) clock may never move.
            deadline = time.monotonic() + hb.wait_s
            while hb.wait_s > 0 and orders.hash == hb.orders_hash:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.wake.changed.wait(remaining)
                if self.wake.version != version:
                    orders, version = self.orders_for(hb.node)
            return self.stamp(orders)

    # -- the reconcile step ---------------------------------------------------------------
    def step(self) -> None:
        """One pass of the control loop: liveness, progress, repair, recovery, placement."""
        self.wakeup.clear()
        now = self.clock.now()
        with self._lock, self.store.transaction():
            self.watchdog.liveness(now)
            self.watchdog.progress(now)
            self.repair.step(now)
            self.executor.retry_waiting(now)
            for job_id in self.allocations.expired(now):
                self.cancel(job_id)
            self._schedule(now)
            self.telemetry.flush(now)

    def _schedule(self, now: float) -> None:
        snapshot = self.planner.run(now)
        if snapshot is not None:  # something changed: evict what ended jobs left behind
            self.orders.keep_only({r.attempt for r in snapshot.running})
            live = set(self.store.job_ids(_LIVE_JOB_STATES))
            self.checkpoints.keep_only(live)
            self.beacons.history.keep_only(live)
            gone = (NodeState.STOPPED, NodeState.RETIRED)
            self.telemetry.keep_only({n.name for n in self.store.nodes() if n.state not in gone})

    # -- operators and the external scheduler ---------------------------------------------
    def node_action(self, name: str, action: NodeAction) -> NodeRow:
        """drain | quarantine | resume | replace a node, with the operator's reason."""
        now = self.clock.now()
        with self._lock, self.store.transaction():
            self.operators.act(self.tx.node(name), action, now)
            self.wake.bump()
            return self.tx.node(name)

    def external_ids(self) -> list[str]:
        """External scheduler ids of the jobs it should be asked about."""
        with self._lock:
            return self.scheduling.external_ids(self.clock.now())

    def observe(self, obs: Observed) -> None:
        """Apply one look at the external scheduler: ended jobs, pending reasons, DOWN nodes."""
        now = self.clock.now()
        with self._lock, self.store.transaction():
            for node, reason in self.scheduling.observe(obs, now):
                self.executor.quarantine(
                    self.tx.node(node.name),
                    reason,
                    FaultKind.NODE_LOST,
                    now,
                    repair=self.cfg.auto_repair,
                )
            self.wake.bump()

    def record_step_failure(self, error: str, in_a_row: int) -> None:
        """The reconcile step started failing (``error``) or recovered (empty ``error``)."""
        try:
            with self._lock, self.store.transaction():
                now = self.clock.now()
                if error:
                    self.store.append(now, ControllerStepFailed(error=error))
                else:
                    self.store.append(now, ControllerStepRecovered(failures=in_a_row))
        except Exception:  # the store itself may be what fails; the log has the error
            log.exception("could not record the reconcile step's failure")

    def flush_energy(self) -> None:
        """Write the energy not yet in the store (a controller that stops on purpose)."""
        with self._lock, self.store.transaction():
            self.telemetry.flush(self.clock.now(), force=True)

    def prune_events(self) -> int:
        """Apply the event log's retention; returns how many events went."""
        with self._lock:
            return self.store.prune_events(self.clock.now(), self.cfg.event_retention_days)

    # -- queries --------------------------------------------------------------------------
    def node_infos(self) -> list[NodeInfo]:
        return self.views.nodes()

    def node_telemetry(self, name: str) -> list[DeviceTelemetry]:
        """The node's devices and their recent samples (NotFound for an unknown node)."""
        with self._lock:
            self.tx.node(name)
            return self.telemetry.of(name)

    def job_info(self, job_id: int, viewer: Principal | None = None) -> JobInfo:
        """The job as ``viewer`` may see it: its env values only for its owner and admins
        (None: the controller's own view, everything)."""
        return self.views.job(job_id, viewer)

    def job_infos(self, include_ended: bool = True, limit: int | None = None) -> list[JobInfo]:
        return self.views.jobs(include_ended, limit)

    def jobs_json(
        self, include_ended: bool = True, limit: int | None = None, viewer: Principal | None = None
    ) -> bytes:
        """:meth:`job_infos` serialised, as ``GET /v1/jobs`` sends it to ``viewer`` (ended
        jobs cached; env values hidden as in :meth:`job_info`)."""
        return self.views.jobs_json(include_ended, limit, viewer)

    def event_infos(
        self,
        *,
        job_id: int | None = None,
        node: str | None = None,
        after: int = 0,
        limit: int | None = None,
    ) -> list[EventInfo]:
        return self.views.events(job_id=job_id, node=node, after=after, limit=limit)

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        return self.views.counts()

    def progress_history(self, job_id: int) -> list[ProgressPoint]:
        """The job's progress points (the dashboard's curves): live jobs' ring, or the thinned
        copy kept of a recently ended one; empty when none is kept."""
        with self._lock:
            return self.beacons.history.of(job_id)
