"""Running a node's health checks on a schedule, and its deep check on order."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from trainpod.agent.health import CheckResult, HealthCheck, run_checks
from trainpod.api.models import DeepCheckOrder, DeepCheckResult, HealthResult

log = logging.getLogger(__name__)


def to_wire(r: CheckResult) -> HealthResult:
    return HealthResult(
        check=r.check,
        status=r.status.value,
        reason=r.reason,
        simulated=r.simulated,
        facts=r.facts,
    )


class HealthMonitor:
    """Runs ``checks`` every ``interval_s`` in a thread; ``on_change`` fires when a verdict
    changes, so a fault is reported at once rather than at the next beat."""

    def __init__(
        self,
        checks: Sequence[HealthCheck],
        *,
        interval_s: float,
        on_change: Callable[[], None],
    ) -> None:
        self._checks = list(checks)
        self._interval = interval_s
        self._on_change = on_change
        self._results: list[HealthResult] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def results(self) -> list[HealthResult]:
        with self._lock:
            return list(self._results)

    def run_once(self) -> list[HealthResult]:
        fresh = [to_wire(r) for r in run_checks(self._checks)]
        with self._lock:
            before = [(r.check, r.status) for r in self._results]
            self._results = fresh
        if [(r.check, r.status) for r in fresh] != before:  # reasons carry live numbers
            for r in fresh:
                if r.status != "ok":
                    log.warning("health %s: %s: %s", r.check, r.status, r.reason)
            self._on_change()
        return fresh

    def reset(self) -> None:
        """Forget sticky faults (past XIDs) and check again: the node passed a deep check
        in place (Slurm nodes are repaired where they are, not replaced by a new agent)."""
        for check in self._checks:
            forget = getattr(check, "reset", None)
            if callable(forget):
                forget()
        self.run_once()

    def start(self) -> None:
        threading.Thread(target=self._loop, name="health", daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.run_once()
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()


class DeepChecker:
    """Runs the deep health check (burn-in) when ordered; one at a time, result kept."""

    def __init__(
        self,
        run: Callable[[float], CheckResult],
        *,
        on_change: Callable[[], None],
        on_pass: Callable[[], None] | None = None,
    ) -> None:
        """``on_pass`` runs after a passing check, before its result is reported."""
        self._run = run
        self._on_change = on_change
        self._on_pass = on_pass
        self._lock = threading.Lock()
        self.result: DeepCheckResult | None = None

    def order(self, order: DeepCheckOrder | None) -> None:
        if order is None:
            return
        with self._lock:
            if self.result is not None and self.result.id == order.id:
                return
            self.result = DeepCheckResult(id=order.id, status="running")
        threading.Thread(target=self._work, args=(order,), daemon=True).start()

    def _work(self, order: DeepCheckOrder) -> None:
        log.info("deep health check %s: starting", order.id)
        try:
            r = self._run(order.timeout_s)
            result = DeepCheckResult(
                id=order.id, status=r.status.value, reason=r.reason, facts=r.facts
            )
        except Exception as exc:  # report it: the controller counts it as a failed repair
            log.exception("deep health check crashed")
            result = DeepCheckResult(id=order.id, status="fault", reason=f"crashed: {exc}")
        log.info("deep health check %s: %s %s", order.id, result.status, result.reason)
        if result.status == "ok" and self._on_pass is not None:
            self._on_pass()
        with self._lock:
            self.result = result
        self._on_change()


def deep_runner(
    devices: int, scratch: Path, gpu_state: Path | None
) -> Callable[[float], CheckResult]:
    def run(timeout_s: float) -> CheckResult:
        from trainpod.agent.health import run_deep_check

        return run_deep_check(max(devices, 1), scratch, gpu_state, timeout_s)

    return run
