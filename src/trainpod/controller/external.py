"""Jobs placed by an external scheduler (Slurm): allocations, requeues, Slurm's view.

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
from typing import Any

from trainpod.controller.base import ControllerBase
from trainpod.controller.ops import ClusterOps, Observed
from trainpod.controller.states import AttemptState, JobState, NodeState, RankState
from trainpod.errors import TrainpodError
from trainpod.store.rows import JobRow, NodeRow

log = logging.getLogger(__name__)

REQUEUED = "job_requeued"
ORPHAN_GRACE_S = 10.0
"""How long a Slurm job may outlive its trainpod job (its agents leaving) before a scancel."""
_HELD = {NodeState.QUARANTINED, NodeState.REPAIRING, NodeState.RETIRED}


class ExternalMixin(ControllerBase):
    ops: ClusterOps
    _stale_agents: set[str]
    _reaped: set[int]
    _released: set[tuple[int, str]]
    """Agents of a requeued or ended allocation: told to leave, never used."""

    @property
    def external(self) -> bool:
        """True when an external scheduler places the jobs (Slurm)."""
        return not self.ops.places_jobs

    # -- submission ---------------------------------------------------------------------
    def _submit_external(self, job_id: int, spec: Any, now: float) -> None:
        """sbatch the job (inside the submit transaction: a refusal leaves no job behind).

        An interactive job (``trainpod alloc``) gets its script written instead; the CLI
        runs it under ``salloc`` and the job's id in Slurm arrives with its agents."""
        if spec.interactive:
            script = self.cfg.jobs_dir / str(job_id) / "alloc.sh"
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_text(self.ops.render(job_id, spec) or "")
            self.store.add_event(now, "external_script", job_id=job_id, path=str(script))
            return
        ext = self.ops.submit(job_id, spec)
        self.store.update_job(job_id, now, external=ext)
        self.store.add_event(now, "external_submitted", job_id=job_id, external_id=ext)

    def _ops_call(self, what: str, now: float, fn: Any, *args: Any, **extra: Any) -> bool:
        """Run a best-effort scheduler operation; a failure becomes an event, not a crash."""
        try:
            fn(*args)
            return True
        except TrainpodError as exc:
            log.warning("%s failed: %s", what, exc)
            self.store.add_event(now, "external_error", action=what, error=str(exc), **extra)
            return False

    # -- allocations --------------------------------------------------------------------
    def _requeues(self, job_id: int) -> int:
        return self.store.count_events(job_id, REQUEUED)

    def _stale_allocation(self, allocation: int | None, round_: int) -> bool:
        """Whether an agent of ``allocation`` (Slurm restart ``round_``) must not be used."""
        if allocation is None or not self.external:
            return False
        job = self.store.job(allocation)
        return job is None or round_ < self._requeues(allocation)

    def _schedule_allocations(self, now: float) -> bool:
        """Start queued jobs whose allocation has enough idle agents; True if any started."""
        started = False
        for job_id in self.store.job_ids([JobState.QUEUED]):
            job = self._job(job_id)
            spec = self._spec(job)
            pool = sorted(
                (
                    n
                    for n in self.store.nodes()
                    if n.allocation == job_id
                    and n.state is NodeState.IDLE
                    and not n.drained
                    and n.job_id is None
                ),
                key=lambda n: n.name,
            )
            if len(pool) < spec.nodes:
                continue
            earlier = self.store.attempts(job_id)
            reason = f"requeued: {job.reason}" if earlier else ""
            self._start_attempt(job, [n.name for n in pool[: spec.nodes]], now, reason)
            started = True
        return started

    def _requeue(self, job: JobRow, bad: list[str], reason: str, now: float) -> None:
        """No spare left in the allocation: requeue in Slurm without the bad nodes.

        The store changes come first (a bug there rolls the transaction back before Slurm
        was touched); a refused requeue then fails the job with Slurm's message."""
        self._release_nodes(job.id, self._held_nodes(job.id), now)
        for node in self.store.nodes():
            if node.allocation == job.id and node.state not in _HELD:
                self._set_node(node, NodeState.STOPPED, now, reason="allocation requeued")
            if node.allocation == job.id:
                self.store.update_node(node.name, now, allocation=None, job_id=None)
        if job.state is not JobState.RECOVERING:
            self._set_job(job, JobState.RECOVERING, now, reason=reason)
        self._set_job(self._job(job.id), JobState.QUEUED, now, reason=reason)
        self.store.add_event(
            now, REQUEUED, job_id=job.id, external_id=job.external, exclude=bad, reason=reason
        )
        ok = self._ops_call("requeue", now, self.ops.requeue, job.external, bad, job_id=job.id)
        if not ok:
            self._set_job(
                self._job(job.id), JobState.FAILED, now, reason=f"{reason}; requeue failed"
            )

    def _allocation_gone(self, node: NodeRow, now: float) -> bool:
        """A node whose allocation ended or was requeued: its agent went with it (Slurm
        kills it, maybe before it said goodbye). Not a fault. True if handled."""
        if node.allocation is None or not self.external:
            return False
        job = self.store.job(node.allocation)
        if job is not None and not job.state.ended:
            return False
        if node.state not in _HELD:
            self._set_node(node, NodeState.STOPPED, now, reason="allocation ended")
        self.store.update_node(node.name, now, allocation=None, job_id=None)
        return True

    # -- Slurm's view -------------------------------------------------------------------
    def external_ids(self) -> list[str]:
        """Slurm ids of the jobs to look at: live ones and those ended in the last hour."""
        with self._lock:
            now = self.clock.now()
            return [
                j.external
                for j in self.store.jobs()
                if j.external and (not j.state.ended or now - (j.ended_at or now) < 3600)
            ]

    def _reap_orphans(self, obs: Observed, now: float) -> None:
        """End Slurm jobs still running after their trainpod job ended. Normally the agents
        leave and the batch script exits; when the batch host died, Slurm (--no-kill) keeps
        the shrunk allocation running with no script to end it."""
        for job in self.store.jobs([JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED]):
            ext = obs.jobs.get(job.external) if job.external else None
            if ext is None or ext.ended or ext.state == "PENDING":
                continue
            if now - (job.ended_at or now) < ORPHAN_GRACE_S:
                continue
            if job.id in self._reaped:
                continue
            self._reaped.add(job.id)
            if self._ops_call("cancel", now, self.ops.cancel, job.external, job_id=job.id):
                self.store.add_event(
                    now, "external_reaped", job_id=job.id, external_id=job.external, was=ext.state
                )

    def observe(self, obs: Observed) -> None:
        """Apply one look at Slurm: jobs that ended there, pending reasons, DOWN nodes."""
        now = self.clock.now()
        with self._lock, self.store.transaction():
            for job in self.store.jobs([s for s in JobState if not s.ended]):
                ext = obs.jobs.get(job.external) if job.external else None
                if ext is None:
                    continue
                if ext.ended:
                    self._end_external(job, f"Slurm job {ext.id} ended: {ext.state}", now)
                elif ext.restarts > self._requeues(job.id):
                    self._requeued_by_slurm(job, ext.restarts, now)
                elif job.state is JobState.QUEUED and ext.state == "PENDING":
                    self._pending(job, ext.id, ext.reason, now)
            self._reap_orphans(obs, now)
            for node in self.store.nodes():
                seen = obs.nodes.get(node.name)
                if node.allocation is None or seen is None or not seen.down:
                    continue
                if node.state in _HELD or node.state is NodeState.STOPPED:
                    continue
                self._slurm_down(node, seen.reason or seen.state, now)
            self._bump()

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
            if self._ops_call("release", now, self.ops.release, external, job_id=job.id):
                self.store.add_event(
                    now, "external_released", job_id=job.id, external_id=external, reason=reason
                )

    def _slurm_down(self, node: NodeRow, why: str, now: float) -> None:
        raise NotImplementedError  # the recovery mixin quarantines

    def _requeued_by_slurm(self, job: JobRow, restarts: int, now: float) -> None:
        """Slurm requeued the job itself (its batch host failed: NODE_FAIL with --requeue).
        The running attempt is gone with the allocation; the job waits for the new one."""
        reason = "Slurm requeued the job (a node of its allocation failed)"
        self._end_attempts(job, cancelled=False, now=now)
        for node in self.store.nodes():
            if node.allocation == job.id:
                if node.state not in _HELD:
                    self._set_node(node, NodeState.STOPPED, now, reason="allocation requeued")
                self.store.update_node(node.name, now, allocation=None, job_id=None)
        for _ in range(restarts - self._requeues(job.id)):
            self.store.add_event(
                now, REQUEUED, job_id=job.id, external_id=job.external, by="slurm", reason=reason
            )
        job = self._job(job.id)
        if job.state is JobState.QUEUED:
            self.store.update_job(job.id, now, reason=reason)
            return
        if job.state is not JobState.RECOVERING:
            if job.state in (JobState.RUNNING, JobState.STARTING):
                self._set_job(job, JobState.RECOVERING, now, reason=reason)
            else:
                self._set_job(job, JobState.STOPPING, now, reason=reason)
                self._set_job(self._job(job.id), JobState.RECOVERING, now, reason=reason)
        self._set_job(self._job(job.id), JobState.QUEUED, now, reason=f"requeued: {reason}")

    def _end_attempts(self, job: JobRow, *, cancelled: bool, now: float) -> None:
        """End the job's live attempts whose ranks went with the allocation (ranks LOST)."""
        for attempt in self.store.attempts(job.id):
            if attempt.state.ended:
                continue
            for r in self.store.ranks(attempt.id):
                if not r.state.ended:
                    self.store.update_rank(attempt.id, r.rank, state=RankState.LOST, ended_at=now)
            if cancelled and attempt.state is not AttemptState.STOPPING:
                self._set_attempt(attempt, AttemptState.STOPPING, now, cause="cancelled")
                attempt = self.store.attempt(attempt.id) or attempt
            final = AttemptState.CANCELLED if cancelled else AttemptState.FAILED
            self._set_attempt(attempt, final, now, cause=attempt.cause or "external")

    def _end_external(self, job: JobRow, reason: str, now: float) -> None:
        """Slurm ended the job (time limit, scancel, node failure): end it here too."""
        cancelled = "CANCELLED" in reason
        self._end_attempts(job, cancelled=cancelled, now=now)
        self._release_nodes(job.id, self._held_nodes(job.id), now)
        job = self._job(job.id)
        if job.state is JobState.RUNNING or job.state is JobState.STARTING:
            self._set_job(job, JobState.STOPPING, now, reason=reason)
            job = self._job(job.id)
        final_job = JobState.CANCELLED if cancelled or job.cancel_requested else JobState.FAILED
        self._set_job(job, final_job, now, reason=reason)
