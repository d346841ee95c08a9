"""The health-check interface: results, run_checks containment, worst()."""

from __future__ import annotations

import json
from typing import ClassVar

from trainpod.agent.health import CheckResult, HealthCheck, Status, run_checks, worst


class Fixed(HealthCheck):
    name: ClassVar[str] = "fixed"

    def __init__(self, status: Status) -> None:
        self.status = status

    def run(self) -> CheckResult:
        return CheckResult(self.name, self.status, "as told", {"n": 1})


class Crashes(HealthCheck):
    name: ClassVar[str] = "crashes"

    def run(self) -> CheckResult:
        raise RuntimeError("boom")


def test_a_crashing_check_becomes_warn_and_the_others_still_run() -> None:
    results = run_checks([Fixed(Status.OK), Crashes(), Fixed(Status.FAULT)])
    assert [r.check for r in results] == ["fixed", "crashes", "fixed"]
    crashed = results[1]
    assert crashed.status is Status.WARN
    assert crashed.reason.startswith("check crashed: ")
    assert "boom" in crashed.reason


def test_worst_orders_ok_warn_fault() -> None:
    ok, warn, fault = (CheckResult("c", s, "") for s in Status)
    assert worst([]) is Status.OK
    assert worst([ok, warn]) is Status.WARN
    assert worst([warn, fault, ok]) is Status.FAULT


def test_to_dict_is_json_ready() -> None:
    d = CheckResult("gpu", Status.FAULT, "why", {"a": [1]}, simulated=True).to_dict()
    assert json.loads(json.dumps(d)) == {
        "check": "gpu",
        "status": "fault",
        "reason": "why",
        "facts": {"a": [1]},
        "simulated": True,
    }
