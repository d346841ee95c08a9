"""Commands on jobs: submit, cancel, hold and release, preempt by hand.

Each runs under the controller's lock, in its transaction, at the time ``now`` it is given
(:class:`~trainpod.controller.core.Controller` takes them and wakes the loop and the polls
after); who may ask is checked before, by :class:`~trainpod.controller.access.Access`.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainpod.controller.allocations import Allocations
from trainpod.controller.config import ControllerConfig
from trainpod.controller.executor import Executor
from trainpod.controller.external import Scheduling
from trainpod.controller.idempotency import Replays, Request
from trainpod.controller.transitions import Transitions
from trainpod.errors import Conflict
from trainpod.model.events import CancelRequested, JobHeld, JobReleased, JobSubmitted
from trainpod.model.states import AttemptState, JobState
from trainpod.scheduler.base import Preempt
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.store.rows import JobRow
from trainpod.store.secrets import MASKED

_WAITING = (JobState.QUEUED, JobState.PREEMPTED)


@dataclass
class JobCommands:
    store: Store
    cfg: ControllerConfig
    tx: Transitions
    scheduling: Scheduling
    executor: Executor
    allocations: Allocations
    replays: Replays

    def submit(self, resolved: JobSpec, now: float) -> int:
        """Queue a job admitted and resolved by :class:`~trainpod.controller.admission.
        Admission`; returns its id."""
        # The secret values go apart; the spec keeps their names, masked (ADR 0032).
        stored = resolved.model_copy(
            update={"secret_env": dict.fromkeys(resolved.secret_env, MASKED)}
        )
        job_id = self.store.insert_job(stored.display_name(), stored.model_dump(mode="json"), now)
        self.tx.secrets.put(job_id, resolved.secret_env)
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
        self.scheduling.submitted(job_id, stored, now)
        self.allocations.submitted(job_id, stored, now)
        return job_id

    def submit_once(
        self, resolved: JobSpec, request: Request, owner: str, key: str, now: float
    ) -> tuple[int, bool]:
        """:meth:`submit` under ``owner``'s idempotency ``key`` (ADR 0037): the job its first
        call made and True, if that call asked for ``request``; else a new job and False.
        Raises :class:`~trainpod.errors.IdempotencyKeyReused` if it asked for another."""
        made = self.replays.made(owner, key, request, now)
        if made is not None:
            return made, True
        job_id = self.submit(resolved, now)
        self.replays.remember(owner, key, request, job_id, now)
        return job_id, False

    def cancel(self, job_id: int, now: float) -> JobRow:
        """Ask for a job to end (idempotent); an ended job raises :class:`Conflict`."""
        job = self.tx.job(job_id)
        if job.state.ended:
            raise Conflict(f"job {job_id} has already ended ({job.state.value})")
        self.store.update_job(job_id, now, cancel_requested=True)
        self.store.append(now, CancelRequested(job_id=job_id))
        self.scheduling.cancelled(job, now)
        if job.state in _WAITING:
            self.tx.set_job(job, JobState.CANCELLED, now, reason="cancelled while queued")
        elif job.state is JobState.RECOVERING and self.tx.active_attempt(job_id) is None:
            self.tx.release_all(job_id, now)
            self.tx.set_job(job, JobState.CANCELLED, now, reason="cancelled while recovering")
        else:
            for attempt in self.store.attempts(job_id):
                self.executor.reconcile(attempt.id, now, {})
        return self.tx.job(job_id)

    def hold(self, job_id: int, by: str, release: bool, now: float) -> JobRow:
        """Hold a waiting job in the queue (``release``: let it be placed again), as ``by``.
        Holding a held job, or releasing one that is not, changes nothing; a job that is not
        waiting raises :class:`Conflict`."""
        job = self.tx.job(job_id)
        if job.state not in _WAITING:
            what = "released" if release else "held"
            raise Conflict(f"job {job_id} is {job.state.value}: only a waiting job can be {what}")
        if release and job.held_by:
            self.store.update_job(job_id, now, held_by="")
            self.store.append(now, JobReleased(job_id=job_id, by=by))
        elif not release and not job.held_by:
            self.store.update_job(job_id, now, held_by=by)
            self.store.append(now, JobHeld(job_id=job_id, by=by))
        return self.tx.job(job_id)

    def preempt(self, job_id: int, reason: str, grace_s: float | None, now: float) -> JobRow:
        """Preempt a running job as a scheduler's ``Preempt`` would (``grace_s`` None: the
        spec's ``preemption.grace_s``); a job with nothing running raises :class:`Conflict`."""
        why = reason.strip() or "preempted by an administrator"
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
        return self.tx.job(job_id)
