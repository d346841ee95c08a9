"""The commands of interactive work (``trainpod alloc``, ``shell``, ``run``), as the API calls
them: each takes the controller's lock (and its transaction where it writes) and hands over
to :class:`~trainpod.controller.allocations.Allocations`, which keeps the leases and builds
shells' contexts and steps' orders.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from trainpod.api.models import AllocationLease, ShellContext, StepPlan, StepRequest
from trainpod.clock import Clock
from trainpod.controller.access import Principal
from trainpod.controller.allocations import Allocations
from trainpod.controller.jobs import JobCommands
from trainpod.controller.transitions import Transitions
from trainpod.controller.wake import Wake
from trainpod.store.repo import Store
from trainpod.store.rows import JobRow


@dataclass
class Interactive:
    lock: threading.RLock
    store: Store
    clock: Clock
    tx: Transitions
    wake: Wake
    allocations: Allocations
    jobs: JobCommands

    def renew(self, job_id: int) -> AllocationLease:
        """The allocation's CLI is still there: renew its lease."""
        with self.lock:
            return self.allocations.renew(job_id, self.clock.now())

    def release(self, job_id: int, reason: str) -> JobRow:
        """The allocation's CLI gives it back (its shell exited): the job is cancelled."""
        now = self.clock.now()
        with self.lock, self.store.transaction():
            job = self.allocations.release(job_id, reason, now)
            if job.state.ended:
                return job
            job = self.jobs.cancel(job_id, now)
            self.wake.bump()
            return job

    def shell(
        self, node: str | None, job_id: int | None, by: Principal | None = None
    ) -> ShellContext:
        """A shell's context; it runs as the caller's POSIX account, if they have one."""
        with self.lock:
            ctx = self.allocations.shell(node, job_id)
        return ctx if by is None else ctx.model_copy(update={"account": by.account})

    def job_on(self, node: str) -> int | None:
        """The job a node is held by now, if any (a node's shell is a shell in it)."""
        with self.lock:
            return self.tx.node(node).job_id

    def start_step(self, job_id: int, req: StepRequest) -> StepPlan:
        """``trainpod run`` inside an allocation: launch orders on its nodes, not queued."""
        now = self.clock.now()
        with self.lock, self.store.transaction():
            return self.allocations.step(job_id, req, now)

    def end_step(self, job_id: int, step: int, exit_code: int) -> None:
        now = self.clock.now()
        with self.lock, self.store.transaction():
            self.allocations.step_ended(job_id, step, exit_code, now)
