"""The GPU check over a simulated GPU: each injected fault gives the right verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainpod.agent.health import (
    GpuCheck,
    SimulatedSource,
    SimulatedStateError,
    Status,
    clear,
    inject,
    simulated_faults,
)
from trainpod.agent.health.gpu import SIMULATED_PREFIX
from trainpod.agent.health.readings import decode_throttle


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "gpu-state.json"


def check(state: Path, count: int = 2) -> GpuCheck:
    return GpuCheck(SimulatedSource(state, count), expected_count=count)


def test_healthy_simulated_gpus(state: Path) -> None:
    result = check(state).run()
    assert result.status is Status.OK
    assert result.simulated is True
    assert result.reason == "simulated GPU: 2 GPUs healthy"
    assert [r["index"] for r in result.facts["readings"]] == [0, 1]
    assert result.facts["readings"][0]["lost"] is False
    assert result.facts["xids"] == []


@pytest.mark.parametrize(
    ("fault", "status", "words"),
    [
        ("xid79", Status.FAULT, "GPU 1: XID 79 (GPU has fallen off the bus)"),
        ("xid48", Status.FAULT, "GPU 1: XID 48 (double-bit ECC error"),
        ("xid13", Status.WARN, "application error"),
        ("ecc", Status.FAULT, "GPU 1: 1 uncorrectable ECC errors"),
        ("thermal", Status.WARN, "GPU 1: throttled (sw_thermal, hw_thermal)"),
        ("remap", Status.FAULT, "GPU 1: row remapping failed"),
        ("lost", Status.FAULT, "GPU 1 lost"),
    ],
)
def test_each_injected_fault(state: Path, fault: str, status: Status, words: str) -> None:
    gpu = check(state)
    inject(state, fault, gpu=1)
    result = gpu.run()
    assert result.status is status
    assert result.reason.startswith(SIMULATED_PREFIX)
    assert words in result.reason


def test_thermal_also_warns_about_temperature(state: Path) -> None:
    inject(state, "thermal", gpu=0)
    result = check(state).run()
    assert "GPU 0: 92 C, above 85 C" in result.reason
    assert result.facts["readings"][0]["throttle_reasons"] == ["sw_thermal", "hw_thermal"]


def test_lost_gpu_is_also_a_count_mismatch(state: Path) -> None:
    inject(state, "lost", gpu=0)
    result = check(state).run()
    assert result.status is Status.FAULT
    assert "expected 2 GPUs, found 1 (1 missing)" in result.reason
    assert "GPU 0 lost" in result.reason
    assert result.facts["count"] == 1
    assert [r["lost"] for r in result.facts["readings"]] == [True, False]


def test_fewer_gpus_than_expected(state: Path) -> None:
    result = GpuCheck(SimulatedSource(state, 3), expected_count=4).run()
    assert result.status is Status.FAULT
    assert "expected 4 GPUs, found 3 (1 missing)" in result.reason


def test_xids_are_returned_once_and_faults_are_sticky_until_reset(state: Path) -> None:
    source = SimulatedSource(state, 2)
    gpu = GpuCheck(source, expected_count=2)
    inject(state, "xid79", gpu=0)
    first = gpu.run()
    assert first.status is Status.FAULT
    assert first.facts["xids"] == [
        {"gpu": 0, "xid": 79, "kind": "node", "meaning": "GPU has fallen off the bus"}
    ]
    assert source.new_xids() == []  # consumed by the run above

    second = gpu.run()  # no new event, but the fault stays
    assert second.status is Status.FAULT
    assert second.facts["xids"] == []
    assert "XID 79" in second.reason

    clear(state)
    assert gpu.run().status is Status.FAULT  # still sticky: the check object remembers
    gpu.reset()
    assert gpu.run().status is Status.OK


def test_application_xid_warns_once_and_is_not_sticky(state: Path) -> None:
    gpu = check(state)
    inject(state, "xid13", gpu=0)
    assert gpu.run().status is Status.WARN
    assert gpu.run().status is Status.OK


def test_clear_makes_a_fresh_check_ok(state: Path) -> None:
    for fault in ("xid79", "ecc", "thermal", "lost", "remap"):
        inject(state, fault, gpu=1)
    assert check(state).run().status is Status.FAULT
    clear(state)
    assert check(state).run().status is Status.OK
    inject(state, "xid48", gpu=0)  # after clear, XIDs count afresh for an old source too
    assert check(state).run().status is Status.FAULT


def test_a_new_source_after_clear_sees_new_xids(state: Path) -> None:
    source = SimulatedSource(state, 2)
    inject(state, "xid79", gpu=0)
    assert source.new_xids() == [(0, 79)]
    clear(state)
    inject(state, "xid13", gpu=1)
    assert source.new_xids() == [(1, 13)]


def test_simulated_faults_for_the_deep_check(state: Path) -> None:
    assert simulated_faults(state) == {}
    inject(state, "xid13", gpu=0)
    inject(state, "thermal", gpu=0)
    assert simulated_faults(state) == {}  # not node faults
    inject(state, "lost", gpu=1)
    inject(state, "xid79", gpu=0)
    faults = simulated_faults(state)
    assert faults[1] == "lost (fallen off the bus)"
    assert "XID 79" in faults[0] and "not cleared" in faults[0]


def test_state_file_schema_is_enforced(state: Path) -> None:
    with pytest.raises(SimulatedStateError, match="unknown fault 'melt'"):
        inject(state, "melt")
    state.write_text(json.dumps({"xids": [], "bogus": 1}))
    with pytest.raises(SimulatedStateError, match="unknown keys \\['bogus'\\]"):
        SimulatedSource(state, 1).count()
    state.write_text("{not json")
    with pytest.raises(SimulatedStateError, match="not JSON"):
        SimulatedSource(state, 1).new_xids()


def test_state_file_written_by_hand(state: Path) -> None:
    state.write_text(
        json.dumps(
            {
                "xids": [{"gpu": 0, "xid": 79}],
                "ecc_uncorrected": {"0": 2},
                "thermal": {"1": True},
                "temperature_c": {"0": 92},
                "lost": [],
                "remap_failure": [0],
                "remap_pending": [1],
                "slow": {},
            }
        )
    )
    result = check(state).run()
    assert result.status is Status.FAULT
    for words in ("XID 79", "2 uncorrectable ECC", "row remapping failed", "row remap pending"):
        assert words in result.reason


def test_decode_throttle() -> None:
    assert decode_throttle(0) == []
    assert decode_throttle(0x4 | 0x20 | 0x40 | 0x80) == [
        "sw_power_cap",
        "sw_thermal",
        "hw_thermal",
        "hw_power_brake",
    ]
    assert decode_throttle(0x8 | 0x1000) == ["hw_slowdown", "bit_0x1000"]


def test_power_cap_alone_is_not_a_warning(state: Path) -> None:
    from trainpod.agent.health.readings import DEFAULT_WARN_THROTTLE

    assert "sw_power_cap" not in DEFAULT_WARN_THROTTLE
    assert {"hw_power_brake", "hw_thermal", "sw_thermal"} <= DEFAULT_WARN_THROTTLE
