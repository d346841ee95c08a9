"""The reachability check: a TCP connect to the controller and to peer nodes."""

from __future__ import annotations

import socket
import time
from typing import Any, ClassVar

from trainpod.agent.health.base import CheckResult, HealthCheck, Status

CONTROLLER = "controller"


class ReachabilityCheck(HealthCheck):
    """TCP-connects to each target (name -> (host, port)) and closes at once.

    Any unreachable target is WARN, never FAULT: when the controller is unreachable the
    agent could not report a fault anyway, and an unreachable peer may be the peer's
    problem. Blocking: up to ``timeout_s`` per unreachable target, targets in order.
    Facts: per target the latency in ms, or the error.
    """

    name: ClassVar[str] = "network"

    def __init__(self, targets: dict[str, tuple[str, int]], timeout_s: float = 1.0) -> None:
        self.targets = dict(targets)
        self.timeout_s = timeout_s

    def run(self) -> CheckResult:
        facts: dict[str, Any] = {}
        down: list[str] = []
        for name, (host, port) in self.targets.items():
            start = time.monotonic()
            try:
                with socket.create_connection((host, port), timeout=self.timeout_s):
                    pass
            except OSError as exc:
                error = str(exc) or type(exc).__name__
                facts[name] = {"host": host, "port": port, "ok": False, "error": error}
                what = "controller unreachable" if name == CONTROLLER else f"{name} unreachable"
                down.append(f"{what} at {host}:{port} ({error})")
                continue
            ms = round((time.monotonic() - start) * 1000, 2)
            facts[name] = {"host": host, "port": port, "ok": True, "latency_ms": ms}
        if down:
            return CheckResult(self.name, Status.WARN, "; ".join(down), facts)
        return CheckResult(self.name, Status.OK, f"{len(self.targets)} targets reachable", facts)
