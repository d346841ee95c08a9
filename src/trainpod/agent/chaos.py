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
from pathlib import Path

from trainpod.agent.health import fill, inject
from trainpod.agent.launcher import Launcher
from trainpod.api.models import ChaosOrder

log = logging.getLogger(__name__)

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
