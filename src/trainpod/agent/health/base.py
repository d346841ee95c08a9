"""The health-check interface: a check is a small object whose ``run()`` returns a verdict.

Contract for every check:

* ``run()`` is blocking but cheap (well under a second), except the deep check, which the
  agent runs only before a node (re)joins.
* ``run()`` returns a :class:`CheckResult`; it should not raise. :func:`run_checks` still
  guards against a check that does, so a buggy check can never take the agent down.
* ``facts`` is JSON-serialisable (plain dicts, lists, numbers, strings, bools, None).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

log = logging.getLogger(__name__)


class Status(str, Enum):
    """A verdict, ordered OK < WARN < FAULT.

    FAULT means the node must not run work (quarantine it); WARN is worth reporting but
    keeps the node in service.
    """

    OK = "ok"
    WARN = "warn"
    FAULT = "fault"

    @property
    def rank(self) -> int:
        """0 for OK, 1 for WARN, 2 for FAULT: compare severities with this."""
        return _RANK[self]


_RANK = {Status.OK: 0, Status.WARN: 1, Status.FAULT: 2}


@dataclass(frozen=True)
class CheckResult:
    """What one check saw: its verdict, a one-line human reason and the raw facts.

    ``simulated`` is true when the verdict is about a simulated device (a CPU slot standing
    in for a GPU), so nothing downstream mistakes it for real hardware.
    """

    check: str
    status: Status
    reason: str
    facts: dict[str, Any] = field(default_factory=dict)
    simulated: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``status`` is its string value."""
        return {
            "check": self.check,
            "status": self.status.value,
            "reason": self.reason,
            "facts": self.facts,
            "simulated": self.simulated,
        }


class HealthCheck(ABC):
    """One node health check. Subclasses set ``name`` and implement ``run``."""

    name: ClassVar[str]

    @abstractmethod
    def run(self) -> CheckResult:
        """Look at the node once and return a verdict. Blocking; should not raise."""


def run_checks(checks: Sequence[HealthCheck]) -> list[CheckResult]:
    """Run every check in order and return one result per check.

    A check that raises becomes ``WARN`` with reason ``"check crashed: <exc>"``: a broken
    check is reported, never fatal to the agent and never by itself a reason to quarantine.
    """
    results: list[CheckResult] = []
    for check in checks:
        name = getattr(check, "name", type(check).__name__)
        try:
            results.append(check.run())
        except Exception as exc:  # a check is third-party-ish code: contain it, report it
            log.warning("health check %s crashed", name, exc_info=True)
            results.append(
                CheckResult(
                    check=name,
                    status=Status.WARN,
                    reason=f"check crashed: {type(exc).__name__}: {exc}",
                    facts={},
                )
            )
    return results


def worst(results: Iterable[CheckResult]) -> Status:
    """The most severe status among ``results``; OK for an empty iterable."""
    status = Status.OK
    for result in results:
        if result.status.rank > status.rank:
            status = result.status
    return status
