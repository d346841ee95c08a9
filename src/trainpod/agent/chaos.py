"""Executing chaos orders on a node: every fault goes through a real mechanism.

Signals to real processes (kill, stop, stop/continue duty cycles), a really killed agent,
a real ballast file past the scratch quota, and the simulated GPU's state file (on a
machine without GPUs; a real GPU cannot be made to fail on purpose, and we say so).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainpod.agent.health import fill, inject
from trainpod.agent.launcher import Launcher
from trainpod.api.models import ChaosOrder

log = logging.getLogger(__name__)

DIE_IN_HANDOFF_ENV = "TRAINPOD_TEST_DIE_IN_HANDOFF"
"""A test seam (tests/integration/test_ckpt_tier_full.py): the path of a file holding a step.
The agent dies, as the kill-agent fault has it, right after it forwarded that step (or a
later one) to the job's persister, before it answered the worker or reported the save; the
file is removed first, so the agent that replaces this one goes on."""

SLOW_PERIOD_S = 0.1
SLOW_DUTY = 0.6  # fraction of each period the rank is stopped


class ChaosExecutor:
    def __init__(
        self,
        *,
        launcher: Launcher,
        gpu_state: Path | None,
        scratch: Path,
        scratch_quota_gib: float | None,
    ) -> None:
        self._launcher = launcher
        self._gpu_state = gpu_state  # None: real GPUs
        self._scratch = scratch
        self._quota = scratch_quota_gib
        self._done: list[str] = []
        self._lock = threading.Lock()

    @property
    def done(self) -> list[str]:
        with self._lock:
            return list(self._done[-100:])

    def execute(self, orders: list[ChaosOrder]) -> None:
        """Run each order once (ids already done are skipped)."""
        for order in orders:
            with self._lock:
                if order.id in self._done:
                    continue
                self._done.append(order.id)
            log.warning("chaos: injecting %s (rank %s)", order.fault, order.rank)
            try:
                self._one(order)
            except Exception:  # a failed injection must not take the agent down
                log.exception("chaos: injecting %s failed", order.fault)

    def _one(self, order: ChaosOrder) -> None:
        f = order.fault
        if f == "kill-worker":
            self._launcher.signal_rank(order.rank, signal.SIGKILL)
        elif f == "hang":
            self._launcher.signal_rank(order.rank, signal.SIGSTOP)
        elif f == "slow":
            threading.Thread(target=self._slow, args=(order.rank,), daemon=True).start()
        elif f == "kill-agent":
            # The node dies with everything on it: ranks first, then this agent, no goodbye.
            self._launcher.kill_everything()
            os.kill(os.getpid(), signal.SIGKILL)
        elif f in ("xid79", "ecc", "thermal"):
            if self._gpu_state is None:
                log.error("chaos: %s needs the simulated GPU; this node has real GPUs", f)
                return
            inject(self._gpu_state, f)
        elif f == "disk-full":
            if self._quota is None:
                log.error("chaos: disk-full needs storage.node_scratch_quota_gib in the spec")
                return
            fill(self._scratch, self._quota)

    def _slow(self, rank: int | None) -> None:
        """Stop and continue the rank in a duty cycle until it ends: a straggler."""
        while True:
            if self._launcher.signal_rank(rank, signal.SIGSTOP) is None:
                return
            time.sleep(SLOW_PERIOD_S * SLOW_DUTY)
            if self._launcher.signal_rank(rank, signal.SIGCONT) is None:
                return
            time.sleep(SLOW_PERIOD_S * (1 - SLOW_DUTY))


def die_in_handoff(trigger: str | None, kill_ranks: Callable[[], None]) -> Callable[[int], None]:
    """The hook :class:`~trainpod.agent.persisters.CheckpointHub` calls with each step it
    forwarded to a persister: a no-op unless ``trigger`` (:data:`DIE_IN_HANDOFF_ENV`) names
    a file with a step in it, and that step has come (then: ranks, then this agent, SIGKILL)."""

    def hook(step: int) -> None:
        if not trigger:
            return
        path = Path(trigger)
        try:
            due = step >= int(path.read_text().strip())
        except (OSError, ValueError):
            return
        if not due:
            return
        try:
            path.unlink()  # once: whoever removes it dies; the replacement agent goes on
        except FileNotFoundError:
            return
        log.warning("test seam %s: killed in the hand-off of step %d", DIE_IN_HANDOFF_ENV, step)
        kill_ranks()
        os.kill(os.getpid(), signal.SIGKILL)

    return hook
