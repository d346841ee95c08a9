"""The node agent: report facts, execute orders, keep workers alive.

Two threads talk to the controller. The beat loop long-polls: it sends a heartbeat and
the reply comes back when the orders change or after about a heartbeat interval. The
reporter sends an immediate heartbeat whenever something changed locally (a rank started
or exited, a lifecycle script finished). While the controller is away both keep retrying;
workers keep running, and the next heartbeat that gets through re-registers the node and
delivers every exit that happened meanwhile.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from trainpod.agent.beacons import BeaconBook, rank_beacon
from trainpod.agent.chaos import ChaosExecutor
from trainpod.agent.devices import DeviceTelemetry
from trainpod.agent.launcher import Launcher
from trainpod.agent.lifecycle import LifecycleRunner
from trainpod.agent.monitor import DeepChecker, HealthMonitor
from trainpod.agent.persisters import CheckpointHub
from trainpod.agent.ranks import Notice
from trainpod.agent.rdzvstore import RendezvousStores
from trainpod.agent.slurmnotice import SlurmNoticeWatch
from trainpod.agent.tensorboard import TensorBoardTap
from trainpod.api.devices import DeviceSample
from trainpod.api.models import AttemptReport, Heartbeat, LaunchOrder, Orders
from trainpod.ckpt.layout import resolve
from trainpod.client.http import TrainpodClient
from trainpod.errors import ControllerUnavailable, TrainpodError

log = logging.getLogger(__name__)

RETRY_S = 0.5


class Agent:
    def __init__(
        self,
        *,
        node: str,
        address: str,
        client: TrainpodClient,
        lifecycle: LifecycleRunner,
        node_env: dict[str, str],
        facts: Any,
        heartbeat_interval_s: float = 1.0,
        teardown_grace_s: float = 5.0,
        beacons: BeaconBook | None = None,
        health: HealthMonitor | None = None,
        deep: DeepChecker | None = None,
        chaos: ChaosExecutor | None = None,
        launcher: Launcher | None = None,
        allocation: dict[str, Any] | None = None,
        checkpoints: CheckpointHub | None = None,
        slurm_notice: SlurmNoticeWatch | None = None,
        tensorboard: TensorBoardTap | None = None,
        telemetry: DeviceTelemetry | None = None,
        stores: RendezvousStores | None = None,
    ) -> None:
        """``facts`` is a zero-argument callable returning the node's current facts.

        ``beacons``, ``health``, ``deep`` and ``chaos`` are optional parts: progress beacons
        from the workers, scheduled health checks, the deep check and fault injection.
        ``stores``: the rendezvous stores this node hosts for the attempts it leads."""
        self.node = node
        self.address = address
        self.agent_id = uuid.uuid4().hex
        self._client = client
        self._lifecycle = lifecycle
        self._facts = facts
        self._interval = heartbeat_interval_s
        self._grace = teardown_grace_s
        self._node_env = node_env
        self._changed = threading.Event()
        self.stopping = threading.Event()
        self._orders_hash: str | None = None
        self._send_lock = threading.Lock()
        self.launcher = launcher or Launcher(node_env=node_env, on_change=self._changed.set)
        self._connected = False
        self._beacons = beacons
        self._health = health
        self._deep = deep
        self._chaos = chaos
        self._skew: tuple[float, float] | None = None  # (controller time, our time) at receipt
        self._checkpoints = checkpoints  # agent-owned checkpoint persistence (None: off)
        # Slurm: {"allocation": job id, "allocation_round": restarts, "group", "devices"}.
        self._allocation = dict(allocation or {})
        self._slurm_notice = slurm_notice  # Slurm's preemption notice (the batch trap's file)
        self._tensorboard = tensorboard  # rank 0's beacons -> the job's TensorBoard scalars
        self._telemetry = telemetry  # per-device readings (NVML, or simulated) for each beat
        self._stores = stores or RendezvousStores()  # the attempts' c10d stores (ADR 0028)
        self.exit_code = 0

    def notify(self) -> None:
        """Something changed locally: report it now rather than at the next beat."""
        self._changed.set()

    # -- the protocol -------------------------------------------------------------------
    def _beat(self, wait_s: float, *, leaving: bool = False) -> Orders | None:
        ran, forgotten = self.launcher.report()
        reports = [self._with_beacons(r) for r in ran]
        if self._slurm_notice is not None:
            # After the reports: an exit they hold that Slurm's SIGTERM caused goes out with
            # Slurm's answer (``preempted_at``, read below), never before it.
            self._slurm_notice.settle()
        hub = self._checkpoints
        ckpts = hub.reports() if hub is not None else []
        hb = Heartbeat(
            node=self.node,
            agent_id=self.agent_id,
            agent_pid=os.getpid(),
            address=self.address,
            facts=self._facts(),
            lifecycle=self._lifecycle.status(),
            attempts=reports,
            forgotten=forgotten,
            orders_hash=self._orders_hash if wait_s else None,
            wait_s=wait_s,
            leaving=leaving,
            health=self._health.results if self._health else [],
            deep_check=self._deep.result if self._deep else None,
            chaos_done=self._chaos.done if self._chaos else [],
            time=time.time(),
            checkpoints=ckpts,
            checkpoint_uploads=hub.uploads() if hub is not None else [],
            preempted_at=self._slurm_notice.preempted_at if self._slurm_notice else None,
            telemetry=self._device_samples(reports),
            **self._allocation,
        )
        asked_at = time.monotonic()  # orders made after this know of every store opened before
        try:
            orders = self._client.heartbeat(hb)
        except ControllerUnavailable as exc:
            if self._connected:
                log.warning("controller unreachable, workers keep running: %s", exc)
            self._connected = False
            return None
        if not self._connected:
            log.info("connected to the controller at %s", self._client.url)
        self._connected = True
        self._skew = (orders.controller_time, time.time())
        self.launcher.delivered(reports)
        if hub is not None:
            hub.delivered(ckpts)
        if self._beacons is not None:
            for gone in {r.attempt_id for r in reports} - self.launcher.attempt_ids():
                self._beacons.forget(gone)
                if self._tensorboard is not None:
                    self._tensorboard.forget(gone)
        self._apply(orders, asked_at)
        return orders

    def _device_samples(self, reports: list[AttemptReport]) -> list[DeviceSample]:
        if self._telemetry is None:
            return []
        busy = {r.local_rank for a in reports for r in a.ranks if r.state == "running"}
        return self._telemetry.samples(busy)

    def _with_beacons(self, report: AttemptReport) -> AttemptReport:
        if self._beacons is None:
            return report
        summary = self._beacons.summary(report.attempt_id)
        beacons = [rank_beacon(b) for b in summary.ranks.values()]
        return report.model_copy(update={"beacons": beacons})

    def controller_time(self) -> float | None:
        """The controller's clock now, as last heard; None before the first reply."""
        if self._skew is None:
            return None
        theirs, ours = self._skew
        return theirs + (time.time() - ours)

    def _apply(self, orders: Orders, asked_at: float) -> None:
        with self._send_lock:
            self._orders_hash = orders.hash
            self._interval = orders.heartbeat_interval_s
            if orders.leave is not None and not self.stopping.is_set():
                log.info("order: leave (the allocation's job ended), exit code %d", orders.leave)
                self.exit_code = orders.leave
                self.stopping.set()
            if self._checkpoints is not None and orders.active_jobs is not None:
                self._checkpoints.retain(set(orders.active_jobs))
            if orders.active_jobs is not None:
                self.launcher.retain(set(orders.active_jobs))
            for kill in orders.kill:
                if self.launcher.kill(kill.attempt_id, kill.grace_s, notice=Notice.of(kill)):
                    log.info("order: kill attempt %d (%s)", kill.attempt_id, kill.reason)
            if self._deep is not None:
                self._deep.order(orders.deep_check)
            if self._chaos is not None and orders.chaos:
                self._chaos.execute(orders.chaos)
            for recover in orders.recover:
                if self._stores.hosts(recover.attempt_id):  # the new generation's store
                    addr, port = recover.master_addr, recover.master_port
                    self._stores.open_soon(recover.attempt_id, addr, port)
                if self.launcher.recover(recover, wait=False):
                    log.info(
                        "order: recover attempt %d in process, generation %d",
                        recover.attempt_id,
                        recover.generation,
                    )
            for launch in orders.launch:
                if _leads(launch):  # opening, in parallel with the ranks' start (ADR 0028)
                    addr, port = launch.env["MASTER_ADDR"], int(launch.env["MASTER_PORT"])
                    self._stores.open_soon(launch.attempt_id, addr, port)
                self._launch(launch)
            self._stores.keep(orders.stores, asked_at=asked_at)

    def _launch(self, launch: LaunchOrder) -> None:
        """Start this node's ranks of an attempt (idempotent; thread-safe)."""
        if self._checkpoints is not None:  # where its ranks' memory tier would be
            env = {**launch.env, **self._node_env}
            memory = resolve(None, env=env, require_durable=False).memory
            self._checkpoints.expect(launch.job_id, memory)
        if self._tensorboard is not None:  # before its ranks can send a beacon
            self._tensorboard.watch(launch)
        if self.launcher.launch(launch, wait=False):
            log.info(
                "order: launched attempt %d of job %d, ranks %s",
                launch.attempt_id,
                launch.job_id,
                [r.rank for r in launch.ranks],
            )

    # -- threads ------------------------------------------------------------------------
    def _beat_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                if self._beat(self._interval) is None:
                    self.stopping.wait(RETRY_S)
            except TrainpodError as exc:
                log.error("heartbeat refused: %s", exc)
                self.stopping.wait(self._interval)

    def _report_loop(self) -> None:
        while not self.stopping.is_set():
            self._changed.wait()
            if self.stopping.is_set():
                return
            self._changed.clear()
            try:
                if self._beat(0.0) is None:
                    self._changed.set()  # deliver it once the controller is back
                    self.stopping.wait(RETRY_S)
            except TrainpodError as exc:
                log.error("report refused: %s", exc)
                self.stopping.wait(RETRY_S)

    def run(self) -> None:
        """Run until :attr:`stopping` is set; then stop the workers and say goodbye."""
        threads = [
            threading.Thread(target=self._lifecycle.run, name="lifecycle", daemon=True),
            threading.Thread(target=self._report_loop, name="reporter", daemon=True),
        ]
        if self._slurm_notice is not None:
            watch = self._slurm_notice.run
            threads.append(
                threading.Thread(
                    target=watch, args=(self.stopping,), name="slurm-notice", daemon=True
                )
            )
        for t in threads:
            t.start()
        if self._health is not None:
            self._health.start()
        self._beat_loop()
        if self._health is not None:
            self._health.stop()
        self._changed.set()
        if self.launcher.pids():
            log.info("stopping %d workers", len(self.launcher.pids()))
        self.launcher.shutdown(self._grace)
        self._stores.close_all()
        preempted = self._slurm_notice is not None and self._slurm_notice.preempted_at is not None
        ending = memory_to_release(self._allocation, preempted)
        if self._checkpoints is not None and ending:
            # Before the goodbye: Slurm kills what is left of the allocation KillWait after
            # its SIGTERM. The persisters finish their newest step first (threads).
            self._checkpoints.end(ending)
        try:
            self._beat(0.0, leaving=True)
        except TrainpodError as exc:
            log.warning("could not say goodbye to the controller: %s", exc)


def memory_to_release(allocation: Mapping[str, Any], preempted: bool) -> set[int]:
    """The jobs whose memory tier on this node an agent that stops removes, whatever its
    orders still call active. The agent of a Slurm allocation (``allocation``: what the
    heartbeat says of it) removes its allocation's job's: the node goes back to Slurm for
    other jobs, and no agent of this cluster may come back to it to do it later (when Slurm
    ends the allocation, the agent that leaves first is told the job is still active: it
    ends with the last rank's exit). Not when Slurm preempts the allocation: the job is
    requeued and may land on the same nodes and load from memory (ADR 0013). Other jobs'
    tiers (a preempted job's, waiting for its next allocation) stay as the orders say. An
    agent outside Slurm removes none: a restarted one finds them, and orders say when
    their jobs end."""
    job = allocation.get("allocation")
    return {int(job)} if job is not None and not preempted else set()


def _leads(order: LaunchOrder) -> bool:
    """This node hosts the attempt's rendezvous store: it runs group rank 0 and the ranks
    are told to connect to an agent's store (ADR 0028)."""
    env = order.env
    return env.get("GROUP_RANK") == "0" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
