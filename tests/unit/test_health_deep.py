"""The deep check: its disk step here, the real subprocess run in the integration tests."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from trainpod.agent.health import Status, inject, run_deep_check
from trainpod.agent.health.deep import disk_step


def test_disk_step_writes_and_verifies(tmp_path: Path) -> None:
    out = disk_step(tmp_path, 2)
    assert out["ok"] is True
    assert len(out["sha256"]) == 64
    assert list(tmp_path.iterdir()) == []


def test_disk_step_on_a_missing_dir_fails(tmp_path: Path) -> None:
    out = disk_step(tmp_path / "missing", 1)
    assert out["ok"] is False
    assert "disk test failed" in out["reason"]


@pytest.mark.integration
def test_deep_check_passes_on_two_cpu_slots(tmp_path: Path) -> None:
    start = time.monotonic()
    result = run_deep_check(2, tmp_path, None, timeout_s=60)
    elapsed = time.monotonic() - start
    assert result.status is Status.OK, result.reason
    assert result.simulated is True
    assert result.reason == "deep check passed on 2 CPU slots (simulated)"
    ranks = result.facts["steps"]["ranks"]
    assert [r["allreduce"]["got"] for r in ranks] == [[1.0], [1.0]]
    assert all(r["matmul"]["ok"] for r in ranks)
    assert result.facts["steps"]["disk"]["ok"] is True
    print(f"deep check, 2 CPU slots: {elapsed:.2f} s")


@pytest.mark.integration
def test_deep_check_fails_on_a_simulated_lost_gpu(tmp_path: Path) -> None:
    state = tmp_path / "gpu-state.json"
    inject(state, "lost", gpu=1)
    result = run_deep_check(2, tmp_path, state, timeout_s=60)
    assert result.status is Status.FAULT
    assert "device cpu:1: matrix product failed (simulated: GPU 1: lost" in result.reason
    assert "cpu:0" not in result.reason


@pytest.mark.integration
def test_deep_check_timeout_is_a_fault(tmp_path: Path) -> None:
    result = run_deep_check(2, tmp_path, None, timeout_s=0.5)
    assert result.status is Status.FAULT
    assert result.reason == "deep check timed out after 0.5 s"
