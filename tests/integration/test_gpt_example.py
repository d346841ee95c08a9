"""End-to-end runs of ``examples/gpt/train.py``: standalone, resumed, and under torchrun."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32"]
TINY += ["--batch-size", "4", "--log-every", "1"]
DIST_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


def _env() -> dict[str, str]:
    """The test's environment minus anything that would make the script think it is distributed."""
    env = {
        k: v for k, v in os.environ.items() if k not in DIST_VARS and not k.startswith("TRAINPOD_")
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(args: list[str], timeout: float = 50) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        args, env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _train(ckpt_dir: Path, steps: int) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPT), "--steps", str(steps), "--ckpt-every", "3"]
    return _run([*cmd, *TINY, "--ckpt-dir", str(ckpt_dir)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def six_step_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    ckpt_dir = tmp_path_factory.mktemp("gpt") / "ckpt"
    return ckpt_dir, _train(ckpt_dir, 6).stdout


def test_standalone_run_writes_checkpoints(six_step_run: tuple[Path, str]) -> None:
    ckpt_dir, out = six_step_run
    assert not any(line.startswith("resum") for line in out.splitlines())
    assert "step 6/6 loss" in out
    assert "done: steps=6 " in out
    names = sorted(p.name for p in ckpt_dir.iterdir())
    assert names == ["step-00000003.pt", "step-00000006.pt", "summary.json"]
    summary = json.loads((ckpt_dir / "summary.json").read_text())
    assert summary["final_step"] == 6
    assert summary["world_size"] == 1


def test_resume_continues_from_latest_checkpoint(
    six_step_run: tuple[Path, str], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(six_step_run[0], ckpt_dir)
    out = _train(ckpt_dir, 9).stdout
    resume_lines = [line for line in out.splitlines() if line.startswith("resum")]
    assert len(resume_lines) == 1 and "step 6" in resume_lines[0], out
    assert "step 7/9 loss" in out
    assert "step 6/9 loss" not in out
    assert "done: steps=9 " in out
    summary = json.loads((ckpt_dir / "summary.json").read_text())
    assert summary["final_step"] == 9
    assert summary["steps_this_run"] == 3
    assert (ckpt_dir / "step-00000009.pt").exists()


def test_torchrun_two_processes(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(_free_port()), str(SCRIPT), "--steps", "4", *TINY]
    out = _run([*cmd, "--ckpt-every", "2", "--ckpt-dir", str(tmp_path)]).stdout
    assert "(world 2)" in out
    assert "done: steps=4 " in out
    assert out.count("done:") == 1  # only rank 0 prints
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["final_step"] == 4
    assert (tmp_path / "step-00000004.pt").exists()
