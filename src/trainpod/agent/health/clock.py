"""The clock check: skew of this node's wall clock against a reference time.

The agent passes the controller's time from its last reply as the reference. Skew breaks
lease and timeout arithmetic between nodes, so a large one is a fault.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from trainpod.agent.health.base import CheckResult, HealthCheck, Status


class ClockCheck(HealthCheck):
    """WARN when ``|now() - reference()|`` exceeds ``warn_s``, FAULT above ``fault_s``.

    ``reference`` returns the reference's current epoch time in seconds, or None when
    there is none yet (then OK). ``now`` defaults to ``time.time``. Never blocks.
    """

    name: ClassVar[str] = "clock"

    def __init__(
        self,
        reference: Callable[[], float | None],
        warn_s: float = 1.0,
        fault_s: float = 30.0,
        *,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.reference = reference
        self.warn_s = warn_s
        self.fault_s = fault_s
        self._now = now

    def run(self) -> CheckResult:
        ref = self.reference()
        if ref is None:
            return CheckResult(self.name, Status.OK, "no reference yet", {"skew_s": None})
        skew = self._now() - ref
        facts = {"skew_s": round(skew, 4), "reference": ref}
        ahead = "ahead of" if skew >= 0 else "behind"
        text = f"clock {abs(skew):.3g} s {ahead} the reference"
        if abs(skew) > self.fault_s:
            return CheckResult(self.name, Status.FAULT, f"{text} (over {self.fault_s:g} s)", facts)
        if abs(skew) > self.warn_s:
            return CheckResult(self.name, Status.WARN, f"{text} (over {self.warn_s:g} s)", facts)
        return CheckResult(self.name, Status.OK, text, facts)
