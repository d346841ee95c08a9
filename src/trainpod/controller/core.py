"""The controller: owns every decision, keeps all state in the store, restartable.

A thin composition: :class:`Controller` owns the lock, the store, the clock and
:meth:`Controller.step`, and delegates to collaborators that get what they need in their
constructors (docs/decisions/0011-composed-controller.md has the diagram of the parts):
``Transitions`` (checked state changes and their events), ``Beats`` (agents' beats, through
``HeartbeatIngest`` and the ``OrderDesk``), the ``Executor`` of the recovery ladder's and the
scheduler's decisions, the ``Planner``'s ``SchedulingPass``, the ``Watchdog``,
``NodeRepair``, the ``Scheduling`` strategy (trainpod or Slurm places jobs), the commands
(``JobCommands``, ``Operators``, ``ChaosDesk``, ``Interactive``), ``Startup`` and the reads
(``Views``, metrics, energy).

All public methods are thread-safe (one lock). Mutations bump a version and wake agents
waiting in a heartbeat long poll, so orders reach agents at once rather than at the next
beat. :meth:`step` is the reconcile loop's body: the daemon calls it a few times a second
and whenever something changed; tests call it directly with a fake clock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from trainpod.api.devices import DeviceTelemetry
from trainpod.api.models import (
    ChaosOrder,
    ChaosRequest,
    EventInfo,
    Heartbeat,
    JobInfo,
    LaunchPlan,
    NodeAction,
    NodeInfo,
    Orders,
    size_sealed_orders,
)
from trainpod.clock import Clock, SystemClock
from trainpod.controller.access import Access, Action, Principal, owned_by
from trainpod.controller.admission import Admission
from trainpod.controller.allocations import Allocations
from trainpod.controller.beats import Beats
from trainpod.controller.books import BeaconBook, ChaosBook
from trainpod.controller.chaos import ChaosDesk
from trainpod.controller.checkpoints import CheckpointEvents
from trainpod.controller.config import ControllerConfig
from trainpod.controller.energy import EnergyViews
from trainpod.controller.executor import Executor
from trainpod.controller.external import Scheduling
from trainpod.controller.history import ProgressPoint
from trainpod.controller.idempotency import Replays, Request
from trainpod.controller.intake import HeartbeatIngest
from trainpod.controller.interactive import Interactive
from trainpod.controller.jobs import JobCommands
from trainpod.controller.metrics import ClusterMetrics
from trainpod.controller.operators import Operators
from trainpod.controller.ops import Observed
from trainpod.controller.orders import OrderDesk
from trainpod.controller.passes import SchedulingPass
from trainpod.controller.planning import Planner
from trainpod.controller.ports import PortAllocator, free_port
from trainpod.controller.repair import NodeRepair, Replacer
from trainpod.controller.startup import Startup
from trainpod.controller.telemetry import TelemetryBook
from trainpod.controller.transitions import Transitions
from trainpod.controller.views import Views
from trainpod.controller.wake import Wake
from trainpod.controller.watch import Watchdog
from trainpod.model.events import ControllerStepFailed, ControllerStepRecovered
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.store.rows import JobRow, NodeRow
from trainpod.store.secrets import JobSecrets

log = logging.getLogger(__name__)

SchedulingFactory = Callable[[Store, ControllerConfig, Transitions], Scheduling]


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
        self.cfg = cfg = config
        self.clock = clock = clock or SystemClock()
        self.started_at = clock.now()
        self._lock = lock = threading.RLock()
        self.wake = Wake(lock)
        self.wakeup = self.wake.step_due  # set when step() has work to do
        self.tx = tx = Transitions(store, cfg, self.wake, ports, JobSecrets(store))
        self.scheduling = sched = scheduling(store, cfg, tx)
        self.beacons = beacons = BeaconBook()
        self.chaos_book = chaos = ChaosBook()
        self.checkpoints = ckpts = CheckpointEvents()
        self.telemetry = telemetry = TelemetryBook(store)
        self.executor = executor = Executor(store, cfg, tx, sched, beacons)
        self.repair = repair = NodeRepair(store, cfg, tx, sched, replacer)
        self.intake = intake = HeartbeatIngest(
            store, cfg, tx, sched, executor, repair, beacons, chaos, ckpts, telemetry
        )
        self.watchdog = Watchdog(store, cfg, tx, sched, executor, beacons)
        self.orders = orders = OrderDesk(store, cfg, tx, sched, chaos, intake.running, clock)
        self.views = Views(
            store, tx, lock, beacons, ckpts, lambda: executor.holds, clock.now, cfg.view_cache_bytes
        )
        self.admission = Admission(cfg, tx, sched)
        self.access = Access(store, clock, lock)
        self.planner = planner = Planner(store, cfg, tx, sched, executor)
        self.passes = SchedulingPass(store, planner, executor, orders, ckpts, beacons, telemetry)
        self.beats = Beats(lock, store, clock, self.wake, tx, intake, orders, self.passes)
        self.energy = EnergyViews(store, cfg, tx, lock, telemetry)
        self.metrics = ClusterMetrics(store, cfg, lock, beacons, telemetry, planner, clock.now)
        size_sealed_orders(len(cfg.nodes))
        self.operators = Operators(store, tx, sched, executor, repair)
        self.allocations = Allocations(store, cfg, tx, ports, leases=sched.leases_allocations)
        self.jobs = jobs = JobCommands(
            store, cfg, tx, sched, executor, self.allocations, Replays(store)
        )
        self.interactive = Interactive(lock, store, clock, tx, self.wake, self.allocations, jobs)
        self.chaos_desk = ChaosDesk(store, tx, chaos)
        self.startup = Startup(store, cfg, sched, self.allocations, self.access)

    @contextmanager
    def _command(self) -> Iterator[float]:
        """A command's hold of the lock and transaction, at its time; once it has run, the
        reconcile loop and the parked polls are woken (a command that raises wakes nobody)."""
        with self._lock, self.store.transaction():
            yield self.clock.now()
            self.wake.bump()

    def bootstrap(self) -> None:
        """Bring the store in line with the spec; give agents a grace period to check in.

        Idempotent: a restarted controller calls it again and loses nothing."""
        with self._command() as now:
            self.startup.run(now)

    # -- jobs -----------------------------------------------------------------------------
    def submit(self, spec: JobSpec, by: Principal | None = None) -> int:
        """Queue a job; returns its id. Raises :class:`SpecError` for a job that can never run.

        ``by``: the caller, who becomes the owner whatever ``spec.user`` says (the API
        always passes it; None: trusted in-process callers such as tests)."""
        if by is not None:
            spec = spec.model_copy(update=owned_by(by))
        resolved = self.admission.resolve(spec)
        with self._command() as now:
            return self.jobs.submit(resolved, now)

    def submit_once(self, spec: JobSpec, by: Principal, key: str) -> tuple[int, bool]:
        """:meth:`submit` with an idempotency key (ADR 0037): the job made by ``by``'s first
        call with ``key`` and True if there was one for the same spec, else the new job's id
        and False. :class:`~trainpod.errors.IdempotencyKeyReused` if that call's spec was
        another; the check and the job's creation are one transaction."""
        request = Request.submit(spec)
        resolved = self.admission.resolve(spec.model_copy(update=owned_by(by)))
        with self._command() as now:
            return self.jobs.submit_once(resolved, request, by.name, key, now)

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
        with self._command() as now:
            return self.jobs.cancel(job_id, now)

    def hold(self, job_id: int, by: Principal, release: bool = False) -> JobRow:
        """Keep a waiting job in the queue, never placed, until released (Slurm's
        ``scontrol hold``); its owner's or an admin's. Holding a held job, or releasing one
        that is not, changes nothing; a job that is not waiting raises :class:`Conflict`."""
        self.authorize(by, Action.HOLD, job_id)
        with self._command() as now:
            return self.jobs.hold(job_id, by.name, release, now)

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
        with self._command() as now:
            return self.jobs.preempt(job_id, reason, grace_s, now)

    def chaos(self, req: ChaosRequest) -> ChaosOrder:
        """Queue a fault for a node's agent to inject through a real mechanism."""
        with self._command() as now:
            return self.chaos_desk.inject(req, now)

    # -- agents (trainpod.controller.beats) -----------------------------------------------
    def beat(self, hb: Heartbeat) -> tuple[Orders, int]:
        """Record an agent's report; its orders now and the version they were made at."""
        return self.beats.beat(hb)

    def orders_for(self, node: str) -> tuple[Orders, int]:
        return self.beats.orders_for(node)

    def serve(self, work: Sequence[Heartbeat | str]) -> list[tuple[Orders, int] | Exception]:
        """Beats and order look-ups (a node's name) under one hold of the lock, committed
        together; a reply for each, in order (an item's error is its reply)."""
        return self.beats.serve(work)

    def stamp(self, orders: Orders) -> Orders:
        return self.beats.stamp(orders)

    def heartbeat(self, hb: Heartbeat) -> Orders:
        """A beat and, with ``hb.wait_s > 0``, a long poll on this thread for new orders."""
        return self.beats.heartbeat(hb)

    # -- the reconcile step ---------------------------------------------------------------
    def step(self) -> None:
        """One pass of the control loop: liveness, progress, repair, recovery, placement."""
        self.wakeup.clear()
        now = self.clock.now()
        with self._lock, self.store.transaction():
            self.watchdog.liveness(now)
            self.watchdog.progress(now)
            self.repair.step(now)
            self.executor.recovery_deadlines(now)
            self.executor.teardown_deadlines(now)
            self.executor.retry_waiting(now)
            for job_id in self.allocations.expired(now):
                self.cancel(job_id)
            self.passes.run(now)
            self.telemetry.flush(now)

    # -- operators and the external scheduler ---------------------------------------------
    def node_action(self, name: str, action: NodeAction) -> NodeRow:
        """drain | quarantine | resume | replace a node, with the operator's reason."""
        with self._command() as now:
            self.operators.act(self.tx.node(name), action, now)
            return self.tx.node(name)

    def external_ids(self) -> list[str]:
        """External scheduler ids of the jobs it should be asked about."""
        with self._lock:
            return self.scheduling.external_ids(self.clock.now())

    def observe(self, obs: Observed) -> None:
        """Apply one look at the external scheduler: ended jobs, pending reasons, DOWN nodes."""
        with self._command() as now:
            self.operators.observed(obs, now)

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

    def close(self) -> None:
        """Close the store (a controller that stops on purpose): the last connection's close
        folds SQLite's write-ahead log into the database file and removes it (ADR 0034)."""
        with self._lock:
            self.store.close()

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
        self,
        include_ended: bool = True,
        limit: int | None = None,
        viewer: Principal | None = None,
        after: int | None = None,
    ) -> bytes:
        """:meth:`job_infos` serialised, as ``GET /v1/jobs`` sends it to ``viewer`` (ended
        jobs cached; env values hidden as in :meth:`job_info`); ``after``: a page of them."""
        return self.views.jobs_json(include_ended, limit, viewer, after)

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
