"""scripts/device_check.py, the GPU checks in one run, works before a GPU's minutes are spent
on it: its smoke run does every step but the GPU-only ones on this CPU (SIMULATED)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_check.py"


@pytest.mark.timeout(600)
def test_the_smoke_run_trains_checkpoints_and_measures_mfu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--steps", "12"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    through = {"trainpod-cluster", "trainpod-train", "trainpod-show", "trainpod-nodes"}
    assert summary["gpu"] is False
    assert set(summary["steps"]) == {"nccl-train", "mfu", "trainpod-delete", *through}
    assert all(s["rc"] == 0 for s in summary["steps"].values()), summary["steps"]
    assert len(summary["checkpoint_stalls_s"]) == 2  # steps 10 and 12 (the last)
    assert len(summary["trainpod_checkpoint_stalls_s"]) == 2  # the same, through trainpod
    assert "done: steps=12" in (out / "trainpod-train.log").read_text()
    assert "simulated" in (out / "trainpod-nodes.log").read_text()  # CPU slots, said so
    assert summary["mfu"]["simulated"] is True
    assert summary["mfu"]["modes"]["eager"]["mfu"]["median"] > 0
    assert "done: steps=12" in (out / "nccl-train.log").read_text()
    assert not (out / "shm").exists()  # the memory tier's copy of the state is not kept
    assert not (out / "shm-trainpod").exists()
