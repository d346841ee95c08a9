"""End-to-end runs of ``examples/gpt/train.py``: standalone, resumed, and under torchrun.

The example checkpoints through ``trainpod.Checkpointer``; a resumed run must end with
bitwise the loss of an uninterrupted one (model, optimizer and data position restored).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainpod.cli.demo import parse_resume

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


def _run(args: list[str], timeout: float = 150) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        args, env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _train(
    ckpt_dir: Path, steps: int, every: str = "3", extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """One standalone run. Its shared-memory tier is a directory next to ``ckpt_dir`` (so
    that nothing is left in /dev/shm), the same for every run in that place."""
    memory = ckpt_dir.parent / "shm"
    cmd = [sys.executable, str(SCRIPT), "--steps", str(steps), "--ckpt-every", every]
    cmd += ["--ckpt-dir", str(ckpt_dir), "--ckpt-memory", str(memory)]
    return _run([*cmd, *TINY, *extra], timeout=400 if "--compile" in extra else 150)


def _resume_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("resum")]


def _summary(ckpt_dir: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((ckpt_dir / "summary.json").read_text())
    return summary


def _committed(ckpt_dir: Path) -> list[int]:
    """Steps with a committed (manifest-bearing) checkpoint in the durable dir."""
    return sorted(int(p.parent.name[5:]) for p in ckpt_dir.glob("step-*/manifest.json"))


def _crashed_copy(run: tuple[Path, str], dest: Path) -> Path:
    """The durable dir the reference run would have left had it died during step 9:
    the checkpoints of steps 3 and 6, not that of step 9 (nor its summary)."""
    shutil.copytree(run[0], dest)
    shutil.rmtree(dest / "step-0000000009")
    (dest / "summary.json").unlink()
    return dest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def nine_step_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The reference: 9 uninterrupted steps, a checkpoint every 3."""
    ckpt_dir = tmp_path_factory.mktemp("gpt") / "ckpt"
    return ckpt_dir, _train(ckpt_dir, 9).stdout


@pytest.mark.timeout(180)  # the module's reference run starts here
def test_standalone_run_writes_checkpoints(nine_step_run: tuple[Path, str]) -> None:
    ckpt_dir, out = nine_step_run
    assert not _resume_lines(out), out
    assert "step 9/9 loss" in out
    assert "done: steps=9 " in out
    assert "checkpoints committed: memory step 9, durable step 9" in out, out
    names = sorted(p.name for p in ckpt_dir.iterdir())
    assert names == [
        "latest",
        "step-0000000003",
        "step-0000000006",
        "step-0000000009",
        "summary.json",
    ]
    assert _committed(ckpt_dir) == [3, 6, 9]
    summary = _summary(ckpt_dir)
    assert summary["final_step"] == 9
    assert summary["steps_this_run"] == 9
    assert summary["world_size"] == 1


@pytest.mark.timeout(330)
def test_resume_after_a_crash_ends_bitwise_as_the_uninterrupted_run(
    nine_step_run: tuple[Path, str], tmp_path: Path
) -> None:
    ckpt_dir = _crashed_copy(nine_step_run, tmp_path / "ckpt")
    out = _train(ckpt_dir, 9).stdout
    (resume,) = _resume_lines(out)
    assert resume.startswith("resuming from step 6 (tier durable, "), out
    assert "fell back" not in out
    said = parse_resume(out.splitlines())  # what `trainpod demo` narrates from this log
    assert said is not None and (said.step, said.tiers, said.fell_back) == (6, ["durable"], [])
    assert "step 7/9 loss" in out
    assert "step 6/9 loss" not in out
    assert "done: steps=9 " in out
    summary, reference = _summary(ckpt_dir), _summary(nine_step_run[0])
    assert summary["final_step"] == 9
    assert summary["steps_this_run"] == 3
    assert summary["final_loss"] == reference["final_loss"]  # bitwise, not approximately
    assert summary["val_loss"] == reference["val_loss"]
    assert _committed(ckpt_dir) == [3, 6, 9]

    # Training on in the same place resumes from the durable tier: outside trainpod a clean
    # close releases the shared-memory tier (RAM nobody else would free); the save interval
    # (here automatic) is no part of the numerics, and the last step is saved.
    out = _train(ckpt_dir, 12, every="auto").stdout
    (resume,) = _resume_lines(out)
    assert resume.startswith("resuming from step 9 (tier durable, "), out
    assert "checkpoints: at the Young/Daly interval (no fault seen yet, MTBF 4 h assumed)" in out
    assert "step 10/12 loss" in out and "done: steps=12 " in out
    assert _summary(ckpt_dir)["steps_this_run"] == 3
    assert _committed(ckpt_dir)[-1] == 12


@pytest.mark.timeout(330)
def test_resume_falls_back_past_a_corrupt_checkpoint(
    nine_step_run: tuple[Path, str], tmp_path: Path
) -> None:
    ckpt_dir = _crashed_copy(nine_step_run, tmp_path / "ckpt")
    # The rank's largest data file: its tensors (staged in place, ADR 0053, from the second
    # save on; the other holds the pickled values).
    shard = max((ckpt_dir / "step-0000000006").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit's worth of damage; same size
    shard.write_bytes(bytes(data))
    out = _train(ckpt_dir, 9).stdout
    (resume,) = _resume_lines(out)
    assert resume.startswith("resuming from step 3 (tier durable, "), out
    reasons = [line for line in out.splitlines() if line.startswith("  fell back: ")]
    assert any("step 6" in r and "crc32c mismatch" in r for r in reasons), out
    said = parse_resume(out.splitlines())
    assert said is not None and said.step == 3 and len(said.fell_back) == len(reasons)
    assert "step 4/9 loss" in out and "done: steps=9 " in out
    summary = _summary(ckpt_dir)
    assert summary["steps_this_run"] == 6
    assert summary["final_loss"] == _summary(nine_step_run[0])["final_loss"]


@pytest.mark.timeout(330)
def test_torchrun_two_processes(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(_free_port()), str(SCRIPT), "--steps", "4", *TINY]
    cmd += ["--ckpt-every", "2", "--ckpt-dir", str(ckpt_dir)]
    out = _run([*cmd, "--ckpt-memory", str(tmp_path / "shm")]).stdout
    assert "(world 2)" in out
    assert "done: steps=4 " in out
    assert out.count("done:") == 1  # only rank 0 prints
    summary = _summary(ckpt_dir)
    assert summary["world_size"] == 2
    assert summary["final_step"] == 4
    assert _committed(ckpt_dir) == [2, 4]


@pytest.mark.timeout(600)  # torch.compile on a 2-core CPU: tens of seconds
def test_the_gpu_configuration_s_switches_run_here_and_resume_eager(tmp_path: Path) -> None:
    """The switches of the gpu-350m preset (bf16 autocast, torch.compile, fused AdamW) on a
    tiny model on this CPU (no GPU here): a compiled run's checkpoint holds the model's own
    state (no ``_orig_mod.`` keys), so an eager run resumes from it and goes on."""
    ckpt = tmp_path / "ckpt"
    gpu = ("--dtype", "bf16", "--fused-adamw")
    compiled = _train(ckpt, 4, every="2", extra=(*gpu, "--compile"))
    assert "precision bf16, compiled, AdamW fused (CPU: no GPU here)" in compiled.stdout
    assert _committed(ckpt)[-1] == 4
    eager = _train(ckpt, 6, every="2", extra=gpu)
    assert "precision bf16, eager, AdamW fused" in eager.stdout
    assert _resume_lines(eager.stdout)[0].startswith("resuming from step 4"), eager.stdout
    done = _summary(ckpt)
    assert done["final_step"] == 6 and done["steps_this_run"] == 2
    assert math.isfinite(done["final_loss"])
