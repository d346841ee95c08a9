"""The host memory check: how full RAM is (``psutil.virtual_memory().percent``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import psutil

from trainpod.agent.health.base import CheckResult, HealthCheck, Status

GIB = 2**30


def _psutil_memory() -> Any:
    return psutil.virtual_memory()


class MemoryCheck(HealthCheck):
    """WARN at ``warn_pct`` used, FAULT at ``fault_pct``. Blocking, microseconds.

    ``probe`` returns an object with ``percent``, ``total`` and ``available`` (bytes) like
    ``psutil.virtual_memory()``; tests pass their own.
    """

    name: ClassVar[str] = "memory"

    def __init__(
        self,
        warn_pct: float = 90,
        fault_pct: float = 98,
        *,
        probe: Callable[[], Any] = _psutil_memory,
    ) -> None:
        if not 0 < warn_pct <= fault_pct <= 100:
            raise ValueError(
                f"need 0 < warn_pct <= fault_pct <= 100, got warn_pct={warn_pct}, "
                f"fault_pct={fault_pct}"
            )
        self.warn_pct = warn_pct
        self.fault_pct = fault_pct
        self._probe = probe

    def run(self) -> CheckResult:
        mem = self._probe()
        pct = float(mem.percent)
        facts = {
            "percent": pct,
            "total_gib": round(mem.total / GIB, 3),
            "available_gib": round(mem.available / GIB, 3),
        }
        text = f"memory {pct:g}% used ({mem.available / GIB:.3g} GiB available)"
        if pct >= self.fault_pct:
            return CheckResult(
                self.name, Status.FAULT, f"{text}, at or above {self.fault_pct:g}%", facts
            )
        if pct >= self.warn_pct:
            return CheckResult(
                self.name, Status.WARN, f"{text}, at or above {self.warn_pct:g}%", facts
            )
        return CheckResult(self.name, Status.OK, text, facts)
