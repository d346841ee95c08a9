"""The scheduling pass, as the reconcile step runs it and as a report that freed nodes does.

:meth:`SchedulingPass.run` is the :class:`~trainpod.controller.planning.Planner`'s pass (if
one is due) followed by the evictions it makes cheap: when something changed, what the
ended jobs left in memory (orders, checkpoint notes, progress history, telemetry of nodes
that are gone) goes. :meth:`SchedulingPass.after_release` is what the step does with nodes
a heartbeat just gave back, at once, so the next job is placed before that reply is sent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainpod.controller.books import BeaconBook
from trainpod.controller.checkpoints import CheckpointEvents
from trainpod.controller.executor import Executor
from trainpod.controller.orders import OrderDesk
from trainpod.controller.planning import Planner
from trainpod.controller.telemetry import TelemetryBook
from trainpod.model.states import JobState, NodeState
from trainpod.store.repo import Store

log = logging.getLogger(__name__)

_LIVE_JOB_STATES = [s for s in JobState if not s.ended]
_GONE = (NodeState.STOPPED, NodeState.RETIRED)


@dataclass
class SchedulingPass:
    store: Store
    planner: Planner
    executor: Executor
    orders: OrderDesk
    checkpoints: CheckpointEvents
    beacons: BeaconBook
    telemetry: TelemetryBook

    def run(self, now: float) -> None:
        """A pass if one is due (under the lock, in the step's transaction)."""
        snapshot = self.planner.run(now)
        if snapshot is not None:  # something changed: evict what ended jobs left behind
            self.orders.keep_only({r.attempt for r in snapshot.running})
            live = set(self.store.job_ids(_LIVE_JOB_STATES))
            self.checkpoints.keep_only(live)
            self.beacons.history.keep_only(live)
            self.telemetry.keep_only({n.name for n in self.store.nodes() if n.state not in _GONE})

    def after_release(self, now: float) -> None:
        """What the step does with freed nodes, now: jobs in recovery that wait for nodes
        first (as in the step), then a pass. One that fails leaves the report recorded: the
        reconcile loop (woken by the report's bump) tries again and keeps the failure's count
        and backoff. Inside a batch of beats the pass joins the batch's transaction: its
        savepoint undoes a failed pass's writes and keeps the beat's."""
        try:
            with self.store.transaction(), self.store.savepoint():
                self.executor.retry_waiting(now)
                self.run(now)
        except Exception:
            log.exception("the scheduling pass after a node was freed failed; the loop retries")
