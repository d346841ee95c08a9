"""Interactive work on the embedded backend: allocations, their leases, shells and steps.

An *allocation* is a job with ``interactive=True`` made by ``trainpod alloc``: queued and
placed like any other job, its one rank per node is ``python -m trainpod.agent.hold``, which
keeps the nodes taken until it is stopped (see that module for why the watchdogs leave it
alone). This module adds what an allocation needs beyond a job
(docs/decisions/0014-interactive-allocations.md):

* **a lease**: the CLI that made the allocation renews it every few seconds while its shell
  runs; an allocation whose CLI went silent for :func:`lease_s` (killed with SIGKILL, its
  host gone) is ended by the controller, and so is one past its ``--time``. The lease is kept
  in memory; a restarted controller gives every live allocation a fresh lease (as it gives
  agents a grace period).
* **a shell's context** (:meth:`Allocations.shell`): the environment, cwd and devices of a
  node, and for a job that job's environment there, computed from the same functions the
  launch orders are built with and the node environment its agent reports; the CLI spawns
  the shell from it.
* **steps** (:meth:`Allocations.step`): ``trainpod run CMD`` inside an allocation gets a
  launch order per node of the allocation, with the torchrun contract and a rendezvous port
  of its own, without queueing: the allocation holds the nodes already.

On Slurm none of this applies: salloc holds the allocation and srun runs steps in it; the
CLI's ``alloc`` goes there (trainpod.cli.slurm), so leases are only kept where the
controller places jobs itself (``leases=True``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainpod.api.models import AllocationLease, LaunchOrder, ShellContext, StepPlan, StepRequest
from trainpod.controller.config import ControllerConfig
from trainpod.controller.launch import launch_order, node_env
from trainpod.controller.ports import PortAllocator
from trainpod.controller.transitions import Transitions
from trainpod.errors import Conflict, SpecError
from trainpod.model.events import AllocationExpired, AllocationReleased, StepEnded, StepStarted
from trainpod.model.states import AttemptState, JobState, NodeState
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.store.rows import AttemptRow, JobRow, NodeRow

#: the least time an allocation survives a silent CLI (a laptop that sleeps a few seconds)
LEASE_FLOOR_S = 15.0
#: set in a shell or a step's environment: the allocation it runs in (``trainpod run``
#: reads it, as ``srun`` reads SLURM_JOB_ID inside salloc)
ALLOCATION_ENV = "TRAINPOD_ALLOCATION"
#: a shell is not a rank: these come with ``trainpod run``'s steps, not with a shell
_RANK_ONLY = (
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TRAINPOD_ATTEMPT_ID",
)
_LIVE_JOBS = [s for s in JobState if not s.ended]
_NO_AGENT = (NodeState.STOPPED, NodeState.RETIRED)


def lease_s(cfg: ControllerConfig) -> float:
    """How long an allocation outlives its silent CLI: three heartbeat timeouts, at least
    :data:`LEASE_FLOOR_S` (a CLI is judged like an agent, only more leniently)."""
    return max(3.0 * cfg.heartbeat_timeout_s, LEASE_FLOOR_S)


@dataclass
class Allocations:
    store: Store
    cfg: ControllerConfig
    tx: Transitions
    ports: PortAllocator
    leases: bool = True  # False where an external scheduler holds allocations (salloc)
    _deadline: dict[int, float] = field(default_factory=dict, init=False)  # job -> lease end
    _steps: dict[int, int] = field(default_factory=dict, init=False)  # job -> last step

    # -- leases ---------------------------------------------------------------------------
    def adopt(self, now: float) -> None:
        """At start-up: every live allocation gets a fresh lease (its CLI may be renewing)."""
        if not self.leases:
            return
        for job in self.store.jobs(_LIVE_JOBS):
            if job.spec.get("interactive"):  # the stored spec, not validated: a long queue
                self._deadline[job.id] = now + lease_s(self.cfg)

    def submitted(self, job_id: int, spec: JobSpec, now: float) -> None:
        if self.leases and spec.interactive:
            self._deadline[job_id] = now + lease_s(self.cfg)

    def renew(self, job_id: int, now: float) -> AllocationLease:
        job, spec = self._allocation(job_id)
        if job.state.ended:
            raise Conflict(
                f"allocation {job_id} has ended ({job.state.value}: {job.reason}); "
                "make a new one with `trainpod alloc`"
            )
        if job.cancel_requested:  # released, expired or cancelled: never re-armed
            raise Conflict(
                f"allocation {job_id} is ending ({job.reason or 'cancel requested'}); "
                "make a new one with `trainpod alloc`"
            )
        lease = lease_s(self.cfg)
        if self.leases:
            self._deadline[job_id] = now + lease
        return AllocationLease(
            job_id=job_id,
            state=job.state,
            reason=job.reason,
            lease_s=lease,
            renew_every_s=max(0.5, min(lease / 5, self.cfg.heartbeat_interval_s * 2)),
            ends_in_s=self._ends_in(job, spec, now),
        )

    def release(self, job_id: int, reason: str, now: float) -> JobRow:
        """The CLI gives the allocation back; the caller then cancels the job."""
        job, _ = self._allocation(job_id)
        self._deadline.pop(job_id, None)
        if not job.state.ended:
            self.store.append(now, AllocationReleased(job_id=job_id, reason=reason))
        return job

    def expired(self, now: float) -> list[int]:
        """Allocations to end now: their CLI went silent, or their ``--time`` ran out. Each
        gets an :class:`AllocationExpired` event; the caller cancels them."""
        due: list[int] = []
        for job_id, deadline in list(self._deadline.items()):
            job = self.store.job(job_id)
            if job is None or job.state.ended:
                del self._deadline[job_id]
                continue
            reason = ""
            ends_in = self._ends_in(job, self.tx.spec(job), now)
            if now > deadline:
                reason = (
                    f"its trainpod alloc stopped renewing the lease for "
                    f"{lease_s(self.cfg):g}s (the CLI was killed or its host is gone)"
                )
            elif ends_in is not None and ends_in <= 0:
                reason = f"its --time {self.tx.spec(job).time_limit} ran out"
            if reason:
                del self._deadline[job_id]
                self.store.append(now, AllocationExpired(job_id=job_id, reason=reason))
                due.append(job_id)
        return due

    def _ends_in(self, job: JobRow, spec: JobSpec, now: float) -> float | None:
        limit = spec.time_limit_s()
        if limit is None or job.started_at is None:
            return None
        return job.started_at + limit - now

    def _allocation(self, job_id: int) -> tuple[JobRow, JobSpec]:
        job = self.tx.job(job_id)
        spec = self.tx.spec(job)
        if not spec.interactive:
            raise SpecError(
                f"job {job_id} is not an allocation (those are made by `trainpod alloc`); "
                "`trainpod shell JOB` opens a shell in any job"
            )
        return job, spec

    # -- shells ---------------------------------------------------------------------------
    def shell(self, node: str | None, job_id: int | None) -> ShellContext:
        """What a shell on ``node`` (for a job: in it, on its first node by default) gets."""
        if job_id is None:
            if node is None:
                raise SpecError("a shell needs a node or a job: `trainpod shell NODE|JOB`")
            row = self._live_node(node)
            env = self._agent_env(row)
            return self._context(row, None, env, Path(env["TRAINPOD_SCRATCH_DIR"]))
        job, attempt = self._running(job_id, "a shell in it")
        node = node or attempt.nodes[0]
        if node not in attempt.nodes:
            raise SpecError(
                f"{node} is not one of job {job_id}'s nodes ({', '.join(attempt.nodes)}); "
                "pass --node with one of them"
            )
        row = self._live_node(node)
        spec = self.tx.spec(job)
        env = {
            k: v
            for k, v in node_env(
                self.cfg,
                job_id=job.id,
                spec=spec,
                attempt_number=attempt.number,
                nodes=attempt.nodes,
                node_index=attempt.nodes.index(node),
                procs_per_node=spec.procs_per_node or 1,
                master_addr=attempt.master_addr,
                master_port=attempt.master_port,
                restart_reason=attempt.restart_reason,
            ).items()
            if k not in _RANK_ONLY
        }
        env.update(self._agent_env(row))  # as the launcher does: the node's own vars win
        if spec.interactive:
            env[ALLOCATION_ENV] = str(job.id)
        scratch = Path(env["TRAINPOD_SCRATCH_DIR"]) / f"job-{job.id}"
        env["TRAINPOD_JOB_SCRATCH_DIR"] = str(scratch)
        return self._context(row, job.id, env, scratch)

    def _context(
        self, row: NodeRow, job_id: int | None, env: dict[str, str], cwd: Path
    ) -> ShellContext:
        devices = row.facts.get("devices")
        devices = devices if isinstance(devices, dict) else {}
        simulated = bool(devices.get("simulated"))
        if simulated:
            note = (
                f"{row.name}'s {devices.get('count', row.devices)} devices are simulated: CPU "
                "slots stand in for GPUs (TRAINPOD_SIMULATED_DEVICES; no CUDA_VISIBLE_DEVICES)"
            )
        elif devices.get("visible"):
            note = f"{row.name}'s GPUs: CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')}"
        else:
            note = f"{row.name} has no devices"
        return ShellContext(
            node=row.name,
            job_id=job_id,
            env=env,
            cwd=str(cwd),
            devices=devices,
            simulated=simulated,
            note=note,
        )

    def _live_node(self, name: str) -> NodeRow:
        row = self.tx.node(name)
        if row.state in _NO_AGENT or row.agent_id is None:
            raise Conflict(
                f"{name} is {row.state.value} and has no running agent to open a shell "
                "through; see `trainpod nodes`"
            )
        return row

    def _agent_env(self, row: NodeRow) -> dict[str, str]:
        """The variables the node's agent gives every rank (its heartbeat's facts)."""
        reported = row.facts.get("env")
        env = {str(k): str(v) for k, v in reported.items()} if isinstance(reported, dict) else {}
        env.setdefault("TRAINPOD_CLUSTER", self.cfg.cluster)
        env.setdefault("TRAINPOD_NODE", row.name)
        env.setdefault("TRAINPOD_SCRATCH_DIR", str(self.cfg.scratch_root / row.name))
        return env

    def _running(self, job_id: int, what: str) -> tuple[JobRow, AttemptRow]:
        job = self.tx.job(job_id)
        if job.state.ended:
            raise Conflict(f"job {job_id} has ended ({job.state.value}); {what} needs it running")
        attempt = self.tx.active_attempt(job_id)
        if (
            job.state is not JobState.RUNNING
            or attempt is None
            or attempt.state is not AttemptState.RUNNING
        ):
            raise Conflict(
                f"job {job_id} is {job.state.value} ({job.reason or 'no reason given'}); "
                f"{what} needs it running: wait, or `trainpod shell NODE` for a node alone"
            )
        return job, attempt

    # -- steps ----------------------------------------------------------------------------
    def step(self, job_id: int, req: StepRequest, now: float) -> StepPlan:
        """``trainpod run``: a launch order per node of the allocation, not queued."""
        _, spec = self._allocation(job_id)
        _, attempt = self._running(job_id, "trainpod run")
        rows = [self._live_node(n) for n in attempt.nodes]
        ppn = req.procs_per_node or max(1, min(r.devices for r in rows))
        try:
            step_spec = JobSpec.model_validate(
                {
                    **spec.model_dump(),
                    "command": req.command,
                    "procs_per_node": ppn,
                    "env": {**spec.env, **req.env},
                    "workdir": req.workdir or spec.workdir,
                }
            )
        except ValueError as exc:
            raise SpecError(f"trainpod run: {exc}") from None
        number = self._next_step(job_id)
        port = self.ports(attempt.master_addr)
        orders: dict[str, LaunchOrder] = {}
        for index, row in enumerate(rows):
            order = launch_order(
                self.cfg,
                job_id=job_id,
                attempt_id=attempt.id,
                spec=step_spec,
                attempt_number=attempt.number,
                nodes=attempt.nodes,
                node_index=index,
                procs_per_node=ppn,
                master_addr=attempt.master_addr,
                master_port=port,
            )
            env = {**order.env, **self._agent_env(row)}
            # The allocation's attempt is the hold; a step's beacons would be read as its
            # and its end as a hang, so steps send none (they are watched by their CLI).
            for key in ("TRAINPOD_ATTEMPT_ID", "TRAINPOD_BEACON_SOCKET"):
                env.pop(key, None)
            env["TORCHELASTIC_RUN_ID"] = f"{env['TORCHELASTIC_RUN_ID']}-step-{number}"
            env["TRAINPOD_STEP"] = str(number)
            # A step's ranks are spawned by its CLI, which hosts their store as torchrun's
            # launcher does and outlives them (cli/steps.py; ADR 0028): every rank is a client.
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
            env[ALLOCATION_ENV] = str(job_id)
            scratch = Path(env["TRAINPOD_SCRATCH_DIR"]) / f"job-{job_id}"
            env["TRAINPOD_JOB_SCRATCH_DIR"] = str(scratch)
            log_dir = self.cfg.jobs_dir / str(job_id) / f"step-{number}"
            if spec.account is not None:
                # The CLI that runs the step is the owner's account (the allocation's shell),
                # which may not write under the cluster's home: the logs go in the job's
                # scratch on the node, the account's alone (the agent made it so, 0700).
                log_dir = scratch / f"step-{number}"
            orders[row.name] = order.model_copy(update={"env": env, "log_dir": str(log_dir)})
        self.store.append(
            now,
            StepStarted(
                job_id=job_id,
                attempt=attempt.number,
                step=number,
                nodes=tuple(attempt.nodes),
                procs_per_node=ppn,
                command=tuple(req.command),
            ),
        )
        return StepPlan(
            job_id=job_id,
            step=number,
            nodes=list(attempt.nodes),
            orders=orders,
            note=f"{len(rows)} nodes x {ppn} ranks; the ranks run on this host (embedded backend)",
        )

    def step_ended(self, job_id: int, step: int, exit_code: int, now: float) -> None:
        job, _ = self._allocation(job_id)
        if step < 1 or step > self._next_step(job_id, peek=True):
            raise SpecError(f"allocation {job_id} has no step {step}")
        attempt = self.tx.active_attempt(job_id)
        self.store.append(
            now,
            StepEnded(
                job_id=job.id,
                attempt=attempt.number if attempt else None,
                step=step,
                exit_code=exit_code,
            ),
        )

    def _next_step(self, job_id: int, *, peek: bool = False) -> int:
        """The number of the allocation's next step (``peek``: the last one's)."""
        last = self._steps.get(job_id)
        if last is None:
            last = self.store.count_events(job_id, StepStarted.kind)
        if peek:
            return last
        self._steps[job_id] = last + 1
        return last + 1
