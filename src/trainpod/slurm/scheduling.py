"""Jobs placed by Slurm: allocations, requeues and Slurm's view, as the controller's
:class:`~trainpod.controller.external.Scheduling` strategy.

With an external scheduler the controller does not choose nodes. A job is submitted there
(``sbatch``); when it runs, one agent per allocated node registers with ``allocation`` =
the trainpod job id, and the job starts on the first ``nodes`` of them. The others are the
job's hot spares: recovery only ever picks spares from the job's own allocation. With none
left, the job is requeued in Slurm (the bad nodes drained and excluded) and starts again,
from its checkpoint, when Slurm runs it again.

Agents of an allocation that was requeued or ended are stale: they are told to leave and
never used again (their ``allocation_round``, Slurm's restart count, is behind).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trainpod.api.models import Heartbeat, LaunchPlan
from trainpod.controller.config import ControllerConfig
from trainpod.controller.external import Scheduling
from trainpod.controller.ops import ClusterOps, Observed
from trainpod.controller.transitions import HELD_NODE_STATES, Transitions
from trainpod.errors import SpecError, TrainpodError
from trainpod.model.events import (
    ExternalError,
    ExternalNodeDown,
    ExternalReaped,
    ExternalReleased,
    ExternalScript,
    ExternalSubmitted,
    JobRequeued,
    NodeAllocated,
    NodeDeclared,
    RecoveryDecision,
)
from trainpod.model.states import AttemptState, JobState, NodeState, RankState
from trainpod.scheduler.base import NodeSlot
from trainpod.scheduler.fifo import AllocationScheduler
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.store.rows import AttemptRow, JobRow, NodeRow

log = logging.getLogger(__name__)

ORPHAN_GRACE_S = 10.0
"""How long a Slurm job may outlive its trainpod job (its agents leaving) before a scancel."""


class SlurmScheduling(Scheduling):
    declares_nodes = False
    checks_in_place = True
    enforces_time_limits = False  # Slurm's --time

    def __init__(
        self, store: Store, config: ControllerConfig, tx: Transitions, ops: ClusterOps
    ) -> None:
        super().__init__(store, config, tx, AllocationScheduler())
        self.ops = ops
        self._stale_agents: set[str] = set()
        """Agents of a requeued or ended allocation: told to leave, never used."""
        self._reaped: set[int] = set()  # jobs whose orphaned Slurm job was cancelled
        self._released: set[tuple[int, str]] = set()  # Slurm holds already released
        self._unresumed: set[str] = set()  # nodes whose resume in Slurm failed: retried

    def _call(
        self,
        what: str,
        now: float,
        fn: Callable[..., object],
        *args: object,
        job_id: int | None = None,
        node: str | None = None,
    ) -> bool:
        """Run a best-effort scheduler operation; a failure becomes an event, not a crash."""
        try:
            fn(*args)
            return True
        except TrainpodError as exc:
            log.warning("%s failed: %s", what, exc)
            self.store.append(
                now, ExternalError(action=what, error=str(exc), job_id=job_id, node=node)
            )
            return False

    def _requeues(self, job_id: int) -> int:
        return self.store.count_events(job_id, JobRequeued.kind)

    # -- submission -------------------------------------------------------------------------
    def check_spec(self, spec: JobSpec, part: str, members: int, spares: int) -> None:
        if members and spec.nodes + spec.spares > members:
            raise SpecError(
                f"the job asks for {spec.nodes} nodes + {spec.spares} spares but partition "
                f"{part!r} has {members} nodes; ask for fewer"
            )

    def submitted(self, job_id: int, spec: JobSpec, now: float) -> None:
        """sbatch the job (inside the submit transaction: a refusal leaves no job behind).

        An interactive job (``trainpod alloc``) gets its script written instead; the CLI
        runs it under ``salloc`` and the job's id in Slurm arrives with its agents."""
        if spec.interactive:
            script = self.cfg.jobs_dir / str(job_id) / "alloc.sh"
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_text(self.ops.render(job_id, spec) or "")
            self.store.append(now, ExternalScript(job_id=job_id, path=str(script)))
            return
        ext = self.ops.submit(job_id, spec)
        self.store.update_job(job_id, now, external=ext)
        self.store.append(now, ExternalSubmitted(job_id=job_id, external_id=ext))

    def dry_run(self, spec: JobSpec, part: str) -> LaunchPlan:
        note = (
            f"Slurm places the job: {spec.nodes} node(s)"
            + (f" + {spec.spares} spare(s)" if spec.spares else "")
            + f" in partition {part!r}; job id 0 stands for the id it will get"
        )
        script = self.ops.render(0, spec)
        return LaunchPlan(
            job=spec, partition=part, nodes=[], orders={}, note=note, batch_script=script
        )

    def cancelled(self, job: JobRow, now: float) -> None:
        if job.external:
            ext = job.external
            self._call("cancel", now, self.ops.cancel, ext, job_id=job.id)

    # -- nodes ------------------------------------------------------------------------------
    def unknown_node(self, hb: Heartbeat, now: float) -> NodeRow | None:
        """A Slurm node seen for the first time: its agent says which group it serves."""
        if hb.allocation is None:
            return None
        group = hb.group or next(iter(self.cfg.partitions.values()))[0]
        self.store.insert_node(hb.node, group, "compute", False, hb.devices or 0, now)
        self.store.append(now, NodeDeclared(node=hb.node, group=group))
        self.tx.learn_node(hb.node)
        return self.tx.node(hb.node)

    def _stale_allocation(self, allocation: int | None, round_: int) -> bool:
        """Whether an agent of ``allocation`` (Slurm restart ``round_``) must not be used."""
        if allocation is None:
            return False
        job = self.store.job(allocation)
        return job is None or round_ < self._requeues(allocation)

    def heartbeat(self, node: NodeRow, hb: Heartbeat, now: float) -> NodeRow:
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
                self.store.append(now, NodeAllocated(node=node.name, job_id=alloc))
            node = self.tx.node(node.name)
        return node

    def leave_code(self, row: NodeRow | None) -> int | None:
        """An allocation agent whose job ended (or was requeued) exits with this."""
        if row is None:
            return None
        if row.agent_id in self._stale_agents:
            return 1
        if row.allocation is None:
            return None
        job = self.store.job(row.allocation)
        if job is None or not job.state.ended:
            return None
        return 0 if job.state is JobState.COMPLETED else 1

    def slot(self, node: NodeRow) -> NodeSlot:
        free = node.state is NodeState.IDLE and not node.drained and node.job_id is None
        return NodeSlot(node.name, node.group, free, node.allocation)

    def allocation_gone(self, node: NodeRow, now: float) -> bool:
        """A node whose allocation ended or was requeued: its agent went with it (Slurm
        kills it, maybe before it said goodbye). Not a fault. True if handled."""
        if node.allocation is None:
            return False
        job = self.store.job(node.allocation)
        if job is not None and not job.state.ended:
            return False
        if node.state not in HELD_NODE_STATES:
            self.tx.set_node(node, NodeState.STOPPED, now, reason="allocation ended")
        self.store.update_node(node.name, now, allocation=None, job_id=None)
        return True

    def recovery_pool(self, job_id: int, rows: list[NodeRow]) -> list[NodeRow]:
        """Only the job's own allocation: its spares are the allocated nodes it does not use."""
        return [n for n in rows if n.allocation == job_id]

    def drain(self, node: str, reason: str, now: float) -> None:
        self._call("drain", now, self.ops.drain, node, reason, node=node)

    def resume(self, node: str, now: float) -> None:
        """Resume the node in Slurm; a refusal (slurmctld busy) is retried on each look at
        Slurm until it takes, or the node is out of service here again."""
        if self._call("resume", now, self.ops.resume, node, node=node):
            self._unresumed.discard(node)
        else:
            self._unresumed.add(node)

    def _retry_resumes(self, obs: Observed, now: float) -> None:
        for name in sorted(self._unresumed):
            row = self.store.node(name)
            seen = obs.nodes.get(name)
            if row is None or row.state in HELD_NODE_STATES or row.drained:
                self._unresumed.discard(name)  # out of service here: nothing to resume
            elif seen is not None and "DRAIN" not in seen.flags and seen.state != "DRAIN":
                self._unresumed.discard(name)  # Slurm has it back already
            else:
                self.resume(name, now)

    # -- recovery ---------------------------------------------------------------------------
    def requeue(self, job: JobRow, attempt: AttemptRow, bad: list[str], now: float) -> str | None:
        """No spare left in the allocation: requeue in Slurm without the bad nodes.

        The store changes come first (a bug there rolls the transaction back before Slurm
        was touched); a refused requeue then fails the job with Slurm's message."""
        if not job.external:
            return None
        reason = f"no spare left in the allocation; requeued in Slurm without {', '.join(bad)}"
        self.store.append(
            now,
            RecoveryDecision(
                job_id=job.id,
                attempt=attempt.number,
                action="requeue",
                reason=reason,
                nodes=(),
                exclude=tuple(bad),
            ),
        )
        self.tx.release_all(job.id, now)
        for node in self.store.nodes():
            if node.allocation == job.id and node.state not in HELD_NODE_STATES:
                self.tx.set_node(node, NodeState.STOPPED, now, reason="allocation requeued")
            if node.allocation == job.id:
                self.store.update_node(node.name, now, allocation=None, job_id=None)
        if job.state is not JobState.RECOVERING:
            self.tx.set_job(job, JobState.RECOVERING, now, reason=reason)
        self.tx.set_job(self.tx.job(job.id), JobState.QUEUED, now, reason=reason)
        self.store.append(
            now,
            JobRequeued(job_id=job.id, external_id=job.external, exclude=tuple(bad), reason=reason),
        )
        ext = job.external
        ok = self._call("requeue", now, self.ops.requeue, ext, bad, job_id=job.id)
        if not ok:
            self.tx.set_job(
                self.tx.job(job.id), JobState.FAILED, now, reason=f"{reason}; requeue failed"
            )
        return reason

    # -- Slurm's view -----------------------------------------------------------------------
    def external_ids(self, now: float) -> list[str]:
        """Slurm ids of the jobs to look at: live ones and those ended in the last hour."""
        return [
            j.external
            for j in self.store.jobs()
            if j.external and (not j.state.ended or now - (j.ended_at or now) < 3600)
        ]

    def observe(self, obs: Observed, now: float) -> list[tuple[NodeRow, str]]:
        """Apply one look at Slurm: jobs that ended there, pending reasons, DOWN nodes."""
        live: set[int] = set()  # live jobs Slurm reports
        for job in self.store.jobs([s for s in JobState if not s.ended]):
            ext = obs.jobs.get(job.external) if job.external else None
            if ext is None:
                continue
            live.add(job.id)
            if ext.ended:
                self._end_external(job, f"Slurm job {ext.id} ended: {ext.state}", now)
            elif ext.restarts > self._requeues(job.id):
                self._requeued_by_slurm(job, ext.restarts, now)
            elif job.state is JobState.QUEUED and ext.state == "PENDING":
                self._pending(job, ext.id, ext.reason, now)
        self._retry_resumes(obs, now)
        ended = self._reap_orphans(obs, now)
        # Forget the jobs Slurm no longer reports.
        self._reaped &= ended
        self._released = {(j, r) for j, r in self._released if j in live | ended}
        down: list[tuple[NodeRow, str]] = []
        for node in self.store.nodes():
            seen = obs.nodes.get(node.name)
            if node.allocation is None or seen is None or not seen.down:
                continue
            if node.state in HELD_NODE_STATES or node.state is NodeState.STOPPED:
                continue
            why = seen.reason or seen.state
            self.store.append(now, ExternalNodeDown(node=node.name, reason=why))
            down.append((node, f"Slurm marks the node down: {why}"))
        return down

    def _reap_orphans(self, obs: Observed, now: float) -> set[int]:
        """End Slurm jobs still running after their trainpod job ended. Normally the agents
        leave and the batch script exits; when the batch host died, Slurm (--no-kill) keeps
        the shrunk allocation running with no script to end it. Returns the ended jobs
        Slurm still reports."""
        visible: set[int] = set()
        for job in self.store.jobs([JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED]):
            ext = obs.jobs.get(job.external) if job.external else None
            if ext is not None:
                visible.add(job.id)
            if ext is None or ext.ended or ext.state == "PENDING":
                continue
            if now - (job.ended_at or now) < ORPHAN_GRACE_S or job.id in self._reaped:
                continue
            self._reaped.add(job.id)
            external = job.external
            if self._call("cancel", now, self.ops.cancel, external, job_id=job.id):
                self.store.append(
                    now,
                    ExternalReaped(
                        job_id=job.id, external_id=job.external, external_state=ext.state
                    ),
                )
        return visible

    def _pending(self, job: JobRow, external: str, reason: str, now: float) -> None:
        """Show why Slurm keeps the job pending; release a job Slurm held after a failed
        launch (a node died under a requeued job): trainpod handles node faults itself."""
        base = (
            job.reason.split("; pending in Slurm")[0] if job.reason.startswith("requeued") else ""
        )
        why = "pending in Slurm" + (f": {reason}" if reason else "")
        why = f"{base}; {why}" if base else why
        if job.reason != why:
            self.store.update_job(job.id, now, reason=why)
        held = "launch failed" in reason.lower() or "requeued held" in reason.lower()
        if held and not job.cancel_requested and (job.id, reason) not in self._released:
            self._released.add((job.id, reason))
            if self._call("release", now, self.ops.release, external, job_id=job.id):
                self.store.append(
                    now, ExternalReleased(job_id=job.id, external_id=external, reason=reason)
                )

    def _requeued_by_slurm(self, job: JobRow, restarts: int, now: float) -> None:
        """Slurm requeued the job itself (its batch host failed: NODE_FAIL with --requeue).
        The running attempt is gone with the allocation; the job waits for the new one."""
        reason = "Slurm requeued the job (a node of its allocation failed)"
        self._end_attempts(job, cancelled=False, now=now)
        for node in self.store.nodes():
            if node.allocation == job.id:
                if node.state not in HELD_NODE_STATES:
                    self.tx.set_node(node, NodeState.STOPPED, now, reason="allocation requeued")
                self.store.update_node(node.name, now, allocation=None, job_id=None)
        for _ in range(restarts - self._requeues(job.id)):
            self.store.append(
                now,
                JobRequeued(job_id=job.id, external_id=job.external, by="slurm", reason=reason),
            )
        job = self.tx.job(job.id)
        if job.state is JobState.QUEUED:
            self.store.update_job(job.id, now, reason=reason)
            return
        if job.state is not JobState.RECOVERING:
            if job.state in (JobState.RUNNING, JobState.STARTING):
                self.tx.set_job(job, JobState.RECOVERING, now, reason=reason)
            else:
                self.tx.set_job(job, JobState.STOPPING, now, reason=reason)
                self.tx.set_job(self.tx.job(job.id), JobState.RECOVERING, now, reason=reason)
        self.tx.set_job(self.tx.job(job.id), JobState.QUEUED, now, reason=f"requeued: {reason}")

    def _end_attempts(self, job: JobRow, *, cancelled: bool, now: float) -> None:
        """End the job's live attempts whose ranks went with the allocation (ranks LOST)."""
        for attempt in self.store.attempts(job.id):
            if attempt.state.ended:
                continue
            for r in self.store.ranks(attempt.id):
                if not r.state.ended:
                    self.store.update_rank(attempt.id, r.rank, state=RankState.LOST, ended_at=now)
            if cancelled and attempt.state is not AttemptState.STOPPING:
                self.tx.set_attempt(attempt, AttemptState.STOPPING, now, cause="cancelled")
                attempt = self.store.attempt(attempt.id) or attempt
            final = AttemptState.CANCELLED if cancelled else AttemptState.FAILED
            self.tx.set_attempt(attempt, final, now, cause=attempt.cause or "external")

    def _end_external(self, job: JobRow, reason: str, now: float) -> None:
        """Slurm ended the job (time limit, scancel, node failure): end it here too."""
        cancelled = "CANCELLED" in reason
        self._end_attempts(job, cancelled=cancelled, now=now)
        self.tx.release_all(job.id, now)
        job = self.tx.job(job.id)
        if job.state is JobState.RUNNING or job.state is JobState.STARTING:
            self.tx.set_job(job, JobState.STOPPING, now, reason=reason)
            job = self.tx.job(job.id)
        final_job = JobState.CANCELLED if cancelled or job.cancel_requested else JobState.FAILED
        self.tx.set_job(job, final_job, now, reason=reason)


def slurm_scheduling(
    ops: ClusterOps,
) -> Callable[[Store, ControllerConfig, Transitions], SlurmScheduling]:
    """The controller's scheduling strategy for a Slurm reached through ``ops``."""

    def build(store: Store, config: ControllerConfig, tx: Transitions) -> SlurmScheduling:
        return SlurmScheduling(store, config, tx, ops)

    return build
