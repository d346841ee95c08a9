"""Memory, clock and reachability verdicts with injected values."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from trainpod.agent.health import ClockCheck, MemoryCheck, ReachabilityCheck, Status

GIB = 2**30


def memory(pct: float) -> MemoryCheck:
    reading = SimpleNamespace(percent=pct, total=64 * GIB, available=(100 - pct) / 100 * 64 * GIB)
    return MemoryCheck(warn_pct=90, fault_pct=98, probe=lambda: reading)


@pytest.mark.parametrize(
    ("pct", "status"), [(50, Status.OK), (90, Status.WARN), (97.9, Status.WARN), (99, Status.FAULT)]
)
def test_memory_thresholds(pct: float, status: Status) -> None:
    result = memory(pct).run()
    assert result.status is status
    assert result.facts["total_gib"] == 64
    assert f"{pct:g}%" in result.reason


def test_memory_default_probe_is_psutil() -> None:
    result = MemoryCheck().run()
    assert 0 < result.facts["percent"] < 100
    assert result.facts["total_gib"] > 0


def test_memory_thresholds_are_validated() -> None:
    with pytest.raises(ValueError, match="warn_pct=99"):
        MemoryCheck(warn_pct=99, fault_pct=90)


@pytest.mark.parametrize(
    ("skew", "status"),
    [
        (0.2, Status.OK),
        (-0.9, Status.OK),
        (2.0, Status.WARN),
        (-5.0, Status.WARN),
        (31, Status.FAULT),
    ],
)
def test_clock_skew(skew: float, status: Status) -> None:
    check = ClockCheck(lambda: 1000.0, now=lambda: 1000.0 + skew)
    result = check.run()
    assert result.status is status
    assert result.facts["skew_s"] == pytest.approx(skew)
    assert ("ahead of" if skew > 0 else "behind") in result.reason


def test_clock_without_reference_is_ok() -> None:
    result = ClockCheck(lambda: None).run()
    assert result.status is Status.OK
    assert result.reason == "no reference yet"


@pytest.fixture
def listener() -> Iterator[tuple[str, int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_reachable_targets_are_ok_with_latency(listener: tuple[str, int]) -> None:
    result = ReachabilityCheck({"controller": listener, "peer": listener}).run()
    assert result.status is Status.OK
    assert result.facts["controller"]["ok"] is True
    assert result.facts["peer"]["latency_ms"] >= 0


def test_unreachable_controller_is_a_warning(listener: tuple[str, int]) -> None:
    port = closed_port()
    check = ReachabilityCheck({"controller": ("127.0.0.1", port), "peer": listener}, timeout_s=0.5)
    result = check.run()
    assert result.status is Status.WARN
    assert result.reason.startswith(f"controller unreachable at 127.0.0.1:{port}")
    assert result.facts["controller"]["ok"] is False
    assert result.facts["controller"]["error"]
    assert result.facts["peer"]["ok"] is True
