"""A reconcile step that keeps failing backs off, says so in an event, and recovers."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from trainpod.controller.daemon import (
    STEP_BACKOFF_MAX_S,
    STEP_INTERVAL_S,
    StepHealth,
    run_reconciler,
)
from trainpod.scheduler.base import Scheduler, SchedulerDecision, Snapshot
from trainpod.scheduler.fifo import FifoScheduler
from trainpod.testing.wait import wait_until

from .conftest import MakeCluster


@dataclass
class Broken(Scheduler):
    """A scheduler with a bug that bites ``failures`` times, then works."""

    failures: int

    def plan(self, snapshot: Snapshot) -> list[SchedulerDecision]:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("a bug in the scheduler")
        return FifoScheduler().plan(snapshot)


def test_a_failing_step_backs_off_records_the_failure_and_the_recovery(
    make_cluster: MakeCluster,
) -> None:
    c = make_cluster(scheduler=Broken(failures=3))
    c.up()
    job = c.submit(nodes=1)
    health = StepHealth()
    stop = threading.Event()
    loop = threading.Thread(target=run_reconciler, args=(c.controller, stop, health))
    loop.start()
    try:
        wait_until(lambda: c.events("controller_step_recovered"), what="the step to recover")
    finally:
        stop.set()
        c.controller.wakeup.set()
        loop.join()
    (failed,) = c.events("controller_step_failed")  # once per run of failures, not per try
    assert failed.data["error"] == "RuntimeError: a bug in the scheduler"
    (recovered,) = c.events("controller_step_recovered")
    assert recovered.data["failures"] == 3
    assert (health.failures_in_a_row, health.total_failures) == (0, 3)
    assert health.last_error == "RuntimeError: a bug in the scheduler"
    assert c.job(job).state == "starting"  # the work went on once the bug stopped biting


def test_the_back_off_doubles_up_to_a_limit() -> None:
    health = StepHealth()
    delays = []
    for _ in range(12):
        health.failures_in_a_row += 1
        delays.append(health.delay_s())
    assert delays[:3] == [STEP_INTERVAL_S * 2, STEP_INTERVAL_S * 4, STEP_INTERVAL_S * 8]
    assert delays[-1] == STEP_BACKOFF_MAX_S
    assert delays == sorted(delays)
    health.failures_in_a_row = 0
    assert health.delay_s() == STEP_INTERVAL_S
