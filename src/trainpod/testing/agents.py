"""A fake node agent that drives a :class:`Controller` directly, without HTTP or processes.

:class:`FakeAgent` speaks the agent protocol the way ``trainpod.agent`` does: every beat
carries the node's lifecycle status and the state of every rank it holds, exits are
reported until the controller has acknowledged them, and a launch order is started at most
once. Nothing runs by itself: a test starts ranks, ends them and beats, one step at a time,
with the controller's (usually fake) clock. :func:`make_config` builds a small
:class:`ControllerConfig` under a temporary directory.

Beyond ranks, a fake agent reports what the real one's side channels would: progress
beacons (:meth:`FakeAgent.progress`, summarised per rank as the agent's beacon book does),
health check results (:meth:`FakeAgent.set_health`) and deep-check results
(:meth:`FakeAgent.deep_check_result`). Chaos orders are recorded (not executed) and
acknowledged on the next beat.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainpod.agent.beacons import BeaconBook, rank_beacon
from trainpod.agent.devices import DeviceTelemetry
from trainpod.agent.ranks import AgentRank
from trainpod.api.devices import DeviceSample
from trainpod.api.models import (
    FORGOTTEN_MAX,
    AttemptReport,
    ChaosOrder,
    DeepCheckResult,
    HealthResult,
    Heartbeat,
    LaunchOrder,
    LifecycleResult,
    LifecycleStatus,
    Orders,
    RankBeacon,
    RecoverOrder,
)
from trainpod.clock import Clock
from trainpod.controller.config import ControllerConfig, NodeDecl
from trainpod.controller.core import Controller

Lifecycle = Literal["ok", "running", "failed"]
HealthStatus = Literal["ok", "warn", "fault"]
DeepStatus = Literal["running", "ok", "warn", "fault"]

_pids = itertools.count(40_000)
_agent_ids = itertools.count(1)


@dataclass
class _Rank(AgentRank):
    """A rank with a fake pid: reported by the launcher's own :class:`AgentRank`."""

    pid: int | None = 0
    """None: reported before its process exists (as the launcher does while it spawns)."""
    log_tail: str = ""
    idle_from: float | None = None
    """Since when (the agent's clock) it has used no CPU; None while it works."""
    clock: Callable[[], float] | None = None

    def _pid(self) -> int | None:
        return self.pid

    def _log_tail(self) -> str:
        return self.log_tail

    def _idle_s(self) -> float | None:
        if self.idle_from is None or self.clock is None:
            return None
        return self.clock() - self.idle_from


@dataclass
class _Run:
    order: LaunchOrder
    ranks: dict[int, _Rank] = field(default_factory=dict)
    step_times: dict[int, float] = field(default_factory=dict)  # rank -> what progress() said


class _AgentClock:
    """The fake agent's clock as it is at each call (it follows a swapped controller's)."""

    def __init__(self, agent: FakeAgent) -> None:
        self._agent = agent

    def now(self) -> float:
        return self._agent.clock.now()


class FakeAgent:
    """One node's agent, stepped by a test. Not thread-safe (one test thread drives it).

    ``agent_id`` defaults to a fresh id; pass the id of an earlier agent to model the same
    agent process reconnecting (after a controller restart), or call :meth:`restarted` to
    model a new agent process that knows nothing of its predecessor's ranks.

    ``clock`` is the agent's own clock (beacon times, ``age_s``, the heartbeat's ``time``);
    by default the controller's, so a test moves both with one FakeClock.
    """

    def __init__(
        self,
        controller: Controller,
        node: str,
        *,
        agent_id: str | None = None,
        address: str = "127.0.0.1",
        agent_pid: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.controller = controller  # public: point it at a restarted controller
        self.node = node
        self.agent_id = agent_id or f"fake-{node}-{next(_agent_ids)}"
        self.address = address
        self.agent_pid = agent_pid if agent_pid is not None else next(_pids)
        self.facts: dict[str, Any] = {}
        self.lifecycle_results: list[LifecycleResult] = []
        self.orders: Orders | None = None  # the reply to the last beat
        self.orders_hash: str | None = None
        self._runs: dict[int, _Run] = {}
        self._beacons = BeaconBook(_AgentClock(self))  # the real agent's book
        self._seen: set[int] = set()  # every attempt ever launched here; never launch twice
        self._forgotten: list[int] = []  # attempts forgotten, newest last (as the Launcher's)
        self._generations: dict[int, int] = {}  # attempt -> newest in-process generation
        self.recovered: list[RecoverOrder] = []  # every recover order acted on, in order
        self._clock = clock
        self.health: dict[str, HealthResult] = {}  # check -> latest result, sent every beat
        self.deep_check: DeepCheckResult | None = None  # sent every beat once set
        self.chaos: list[ChaosOrder] = []  # every chaos order received, in arrival order
        self.ack_chaos = True  # acknowledge received chaos orders on the next beat
        self._chaos_done: list[str] = []
        # Slurm: {"allocation": job, "allocation_round": n, "external_id": ..., "group": ...}
        self.allocation: dict[str, Any] = {}
        # Device telemetry sent with every beat (None: none), e.g. the agent's real
        # DeviceTelemetry over a SimulatedReader on this agent's clock.
        self.devices: DeviceTelemetry | None = None

    @property
    def clock(self) -> Clock:
        return self._clock if self._clock is not None else self.controller.clock

    def _now(self) -> float:
        return self.clock.now()

    # -- the protocol -------------------------------------------------------------------
    def heartbeat(
        self, lifecycle: Lifecycle = "ok", wait_s: float = 0.0, *, leaving: bool = False
    ) -> Heartbeat:
        """The heartbeat :meth:`beat` would send now."""
        results = self.lifecycle_results
        if lifecycle == "failed" and not results:
            results = [failed_script()]
        return Heartbeat(
            node=self.node,
            agent_id=self.agent_id,
            agent_pid=self.agent_pid,
            address=self.address,
            facts=dict(self.facts),
            lifecycle=LifecycleStatus(state=lifecycle, results=list(results)),
            attempts=self.reports(),
            forgotten=self._forgotten[-FORGOTTEN_MAX:],
            orders_hash=self.orders_hash if wait_s else None,
            wait_s=wait_s,
            leaving=leaving,
            health=[h for _, h in sorted(self.health.items())],
            deep_check=self.deep_check,
            chaos_done=list(self._chaos_done) if self.ack_chaos else [],
            time=self._now(),
            telemetry=self._device_samples(),
            **self.allocation,
        )

    def _device_samples(self) -> list[DeviceSample]:
        if self.devices is None:
            return []
        runs = self._runs.values()
        busy = {r.local_rank for run in runs for r in run.ranks.values() if r.running}
        return self.devices.samples(busy)

    def beat(
        self, lifecycle: Lifecycle = "ok", wait_s: float = 0.0, *, leaving: bool = False
    ) -> Orders:
        """Send a heartbeat and return the orders; blocks up to ``wait_s`` (a long poll).

        Like the real agent, exits the controller has now recorded are forgotten once every
        rank of their attempt has been reported ended. Orders are not executed: call
        :meth:`start_ranks` and :meth:`kill_ranks` for that.
        """
        hb = self.heartbeat(lifecycle, wait_s, leaving=leaving)
        orders = self.controller.heartbeat(hb)
        self._delivered(hb.attempts)
        self._received_chaos(orders)
        self.orders = orders
        self.orders_hash = orders.hash
        return orders

    def _received_chaos(self, orders: Orders) -> None:
        """Record new chaos orders; acknowledge (on the next beat) those still ordered."""
        known = {c.id for c in self.chaos}
        self.chaos.extend(c for c in orders.chaos if c.id not in known)
        self._chaos_done = [c.id for c in orders.chaos]

    def _delivered(self, reports: list[AttemptReport]) -> None:
        for rep in reports:
            run = self._runs.get(rep.attempt_id)
            if run is None:
                continue
            for rr in rep.ranks:
                if rr.state == "exited" and rr.rank in run.ranks:
                    run.ranks[rr.rank].delivered = True
            if all(r.delivered for r in run.ranks.values()):
                self.forget(rep.attempt_id)

    def forget(self, attempt_id: int) -> None:
        """Forget an attempt as the agent does once every rank's exit was acknowledged; called
        directly, it is an agent that lost track of live ranks (the bug the controller's
        intake guards against: ``HeartbeatIngest._lose_forgotten``)."""
        if self._runs.pop(attempt_id, None) is not None:
            self._forgotten.append(attempt_id)
        self._beacons.forget(attempt_id)

    def reports(self) -> list[AttemptReport]:
        """What the agent reports about its ranks, as ``Launcher.reports`` does."""
        return [
            AttemptReport(
                attempt_id=aid,
                job_id=run.order.job_id,
                ranks=[r.report() for _, r in sorted(run.ranks.items())],
                beacons=list(self._summaries(aid, run).values()),
            )
            for aid, run in sorted(self._runs.items())
        ]

    def _summaries(self, attempt_id: int, run: _Run) -> dict[int, RankBeacon]:
        """The beacon book's summaries, sent as the real agent sends them; the step times
        are progress()'s (the book's would be a median over the last steps)."""
        return {
            r: rank_beacon(dataclasses.replace(b, step_time_s=run.step_times.get(r)))
            for r, b in self._beacons.summary(attempt_id).ranks.items()
        }

    # -- side channels ------------------------------------------------------------------
    def progress(
        self,
        attempt_id: int,
        rank: int,
        step: int,
        at: float | None = None,
        step_time_s: float | None = None,
        checkpoint_step: int | None = None,
        checkpoint_stall_s: float = 0.0,
        **extra: float,
    ) -> RankBeacon:
        """Rank ``rank`` reports ``step`` at ``at`` (default: now, by the agent's clock),
        with ``extra`` metrics as ``trainpod.report`` passes them (``loss=``, ``tokens=``).

        The next beats carry the rank's summary (a :class:`RankBeacon` whose ``age_s`` is
        measured at each beat). ``step_time_s`` defaults to the time per step since the
        previous report, or the last known value. Raises KeyError for a rank this agent does
        not run. Returns the summary as of now.
        """
        run = self._runs[attempt_id]
        if rank not in run.ranks:
            raise KeyError(f"rank {rank} of attempt {attempt_id} does not run on {self.node}")
        at = self._now() if at is None else at
        prev = self._beacons.summary(attempt_id).ranks.get(rank)
        if step_time_s is None and prev is not None:  # the time per step since the last report
            last_step, last_at = prev.last_step, prev.last_at
            if last_step is not None and step > last_step and at >= last_at:
                step_time_s = (at - last_at) / (step - last_step)
        if step_time_s is not None:
            run.step_times[rank] = step_time_s
        metrics: dict[str, Any] = dict(extra)
        if checkpoint_step is not None:
            metrics["checkpoint_step"] = checkpoint_step
        if checkpoint_stall_s:
            metrics["checkpoint_stall_s"] = checkpoint_stall_s
        # The sender's time is the receive time: a fake rank's clock is the agent's.
        self._beacons.record(attempt_id, rank, step, at, metrics or None, now=at)
        return self._summaries(attempt_id, run)[rank]

    def set_health(
        self, check: str, status: HealthStatus = "ok", reason: str = "", **facts: Any
    ) -> HealthResult:
        """The latest result of health check ``check``, sent with every beat from now on."""
        result = HealthResult(check=check, status=status, reason=reason, facts=facts)
        self.health[check] = result
        return result

    def deep_check_result(
        self, id: str | None = None, status: DeepStatus = "ok", reason: str = ""
    ) -> DeepCheckResult:
        """The result of deep check ``id`` (default: the one in the last orders), sent with
        every beat from now on."""
        if id is None:
            ordered = self.orders.deep_check if self.orders is not None else None
            if ordered is None:
                raise ValueError(f"{self.node} holds no deep check order; pass its id")
            id = ordered.id
        self.deep_check = DeepCheckResult(id=id, status=status, reason=reason)
        return self.deep_check

    # -- executing orders ---------------------------------------------------------------
    def start_ranks(self, orders: Orders | None = None) -> list[int]:
        """Start the ranks of every launch order (default: the last orders); fake pids.

        Idempotent per attempt, as the real launcher is. Returns the ranks started now.
        """
        orders = orders if orders is not None else self.orders
        started: list[int] = []
        if orders is None:
            return started
        now = self._now()
        for launch in orders.launch:
            if launch.attempt_id in self._seen:
                continue
            self._seen.add(launch.attempt_id)
            run = _Run(launch)
            for slot in launch.ranks:
                run.ranks[slot.rank] = _Rank(slot.rank, slot.local_rank, now, pid=next(_pids))
                started.append(slot.rank)
            self._runs[launch.attempt_id] = run
        return started

    def recover_ranks(self, orders: Orders | None = None) -> list[int]:
        """Obey the recover orders (default: the last orders) as ``Launcher.recover`` does:
        once per generation, start this node's replaced ranks again (new fake pids; one
        still running is ended first). Returns the ranks started now."""
        orders = orders if orders is not None else self.orders
        started: list[int] = []
        now = self._now()
        for rec in orders.recover if orders is not None else []:
            run = self._runs.get(rec.attempt_id)
            if run is None or rec.generation <= self._generations.get(rec.attempt_id, 0):
                continue
            self._generations[rec.attempt_id] = rec.generation
            self.recovered.append(rec)
            for rank in rec.respawn:
                old = run.ranks[rank]
                run.ranks[rank] = _Rank(rank, old.local_rank, now, pid=next(_pids))
                started.append(rank)
        return started

    def exit_rank(
        self,
        attempt_id: int,
        rank: int,
        code: int | None = 0,
        signal: int | None = None,
        tail: str = "",
    ) -> None:
        """End a running rank with an exit ``code`` or, when ``signal`` is set, by a signal.

        ``tail`` is the rank's log tail, reported (as the real agent does) only when the
        rank failed. Raises KeyError for a rank this agent does not run.
        """
        r = self._runs[attempt_id].ranks[rank]
        if not r.running:
            raise ValueError(f"rank {rank} of attempt {attempt_id} has already ended")
        r.ended_at = self._now()
        r.exit_code, r.signal = (None, signal) if signal is not None else (code, None)
        r.log_tail = tail

    def exit_all(self, attempt_id: int, code: int = 0) -> None:
        """End every running rank of the attempt with ``code``."""
        for rank in self.running_ranks(attempt_id):
            self.exit_rank(attempt_id, rank, code)

    def kill_ranks(self, orders: Orders | None = None, signal: int = 15) -> list[int]:
        """Obey the kill orders (default: the last orders): end their running ranks by
        ``signal``, as SIGTERM would. Returns the ranks ended now."""
        orders = orders if orders is not None else self.orders
        killed: list[int] = []
        for kill in orders.kill if orders is not None else []:
            for rank in self.running_ranks(kill.attempt_id):
                self.exit_rank(kill.attempt_id, rank, signal=signal)
                killed.append(rank)
        return killed

    # -- inspection and restarts --------------------------------------------------------
    def running_ranks(self, attempt_id: int) -> list[int]:
        run = self._runs.get(attempt_id)
        if run is None:
            return []
        return [r.rank for _, r in sorted(run.ranks.items()) if r.running]

    def pid(self, attempt_id: int, rank: int) -> int:
        pid = self._runs[attempt_id].ranks[rank].pid
        assert pid is not None, f"rank {rank} of attempt {attempt_id} has no pid yet"
        return pid

    def set_idle(self, attempt_id: int, rank: int, idle: bool) -> None:
        """From now on ``rank`` uses no CPU (its reported idle time grows), or works again."""
        r = self._runs[attempt_id].ranks[rank]
        r.idle_from, r.clock = (self._now(), self._now) if idle else (None, None)

    def set_pid(self, attempt_id: int, rank: int, pid: int | None) -> None:
        """Report ``rank`` with this pid from now on (None: its process not spawned yet)."""
        self._runs[attempt_id].ranks[rank].pid = pid

    @property
    def attempts(self) -> list[int]:
        """Attempts whose ranks this agent still holds (running or exit not yet delivered)."""
        return sorted(self._runs)

    def restarted(self) -> FakeAgent:
        """A new agent process on the same node: new id and pid, no ranks, no orders, no
        health or deep-check results; the same clock."""
        return FakeAgent(self.controller, self.node, address=self.address, clock=self._clock)


def failed_script(
    script: str = "setup.sh", exit_code: int = 1, tail: str = "setup failed", log_path: str = ""
) -> LifecycleResult:
    """A lifecycle result for a script that failed."""
    return LifecycleResult(
        script=script,
        state="failed",
        exit_code=exit_code,
        duration_s=0.1,
        log_path=log_path or f"/var/log/trainpod/{script}.log",
        tail=tail,
    )


@dataclass(frozen=True)
class FakeGroup:
    """An instance group for :func:`make_config`; nodes are named ``<name>-<i>``."""

    name: str
    count: int = 2
    devices: int = 2
    spare: bool = False
    role: str = "compute"


def make_config(
    root: Path,
    *,
    groups: Sequence[FakeGroup | tuple[str, int]] = (FakeGroup("workers"),),
    partitions: dict[str, list[str]] | None = None,
    default_partition: str | None = None,
    cluster: str = "test",
    heartbeat_interval_s: float = 1.0,
    heartbeat_timeout_s: float = 10.0,
    teardown_grace_s: float = 5.0,
    max_restarts: int = 3,
    hang_timeout_s: float = 120.0,
    exit_wait_s: float = 60.0,
    straggler_factor: float = 1.5,
    straggler_checks: int = 5,
    auto_repair: bool = True,
    retire_after: int = 3,
    deep_check_timeout_s: float = 180.0,
    view_cache_bytes: int = 64 << 20,
) -> ControllerConfig:
    """A :class:`ControllerConfig` with its directories under ``root`` (created lazily).

    ``groups`` take ``(name, count)`` as a shorthand for a compute group of 2-device nodes.
    Without ``partitions``: one partition ``default`` with every compute group, spares
    included, as a cluster spec without a ``partitions`` key has.
    """
    decls = [g if isinstance(g, FakeGroup) else FakeGroup(g[0], g[1]) for g in groups]
    if partitions is None:
        partitions = {"default": [g.name for g in decls if g.role == "compute"]}
    return ControllerConfig(
        cluster=cluster,
        backend="local",
        nodes=[
            NodeDecl(f"{g.name}-{i}", g.name, g.role, g.spare, g.devices)
            for g in decls
            for i in range(g.count)
        ],
        partitions=partitions,
        default_partition=default_partition or next(iter(partitions)),
        jobs_dir=root / "jobs",
        shared_dir=root / "shared",
        scratch_root=root / "scratch",
        checkpoint_uri=f"file://{root / 'checkpoints'}",
        heartbeat_interval_s=heartbeat_interval_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
        teardown_grace_s=teardown_grace_s,
        max_restarts=max_restarts,
        hang_timeout_s=hang_timeout_s,
        exit_wait_s=exit_wait_s,
        straggler_factor=straggler_factor,
        straggler_checks=straggler_checks,
        auto_repair=auto_repair,
        retire_after=retire_after,
        deep_check_timeout_s=deep_check_timeout_s,
        view_cache_bytes=view_cache_bytes,
    )
