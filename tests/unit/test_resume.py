"""``{resume:DIR}``: the newest complete checkpoint, the placeholder's checks (ADR 0030)."""

from __future__ import annotations

import json
import struct
import sys
import zipfile
from pathlib import Path

import pytest

from trainpod.agent.launcher import Launcher
from trainpod.api.models import LaunchOrder, RankSlot
from trainpod.resume import ResumeSyntaxError, check_command, expand, incomplete, newest_complete
from trainpod.spec.job import JobSpec
from trainpod.testing.wait import wait_until


def torch_file(path: Path, payload: bytes = b"x" * 64) -> None:
    """A file in torch.save's format: a zip archive (its central directory written last)."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", payload)


def safetensors(path: Path, nbytes: int = 16) -> None:
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [0, nbytes]}}
    )
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * nbytes)


def hf_checkpoint(out: Path, step: int, world: int = 2) -> Path:
    """What the Trainer writes: weights, optimizer, per-rank RNG, then trainer_state.json."""
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    safetensors(d / "model.safetensors")
    torch_file(d / "optimizer.pt")
    for r in range(world):
        torch_file(d / f"rng_state_{r}.pth")
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return d


def cut(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def test_the_newest_complete_checkpoint_wins_and_half_written_ones_are_skipped(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    for step in (10, 20, 30, 40, 50):
        hf_checkpoint(out, step)
    (out / "checkpoint-50" / "trainer_state.json").unlink()  # killed before its last file
    cut(out / "checkpoint-40" / "optimizer.pt", 30)  # killed inside torch.save
    (out / "checkpoint-30" / "rng_state_1.pth").unlink()  # rank 1 killed before its RNG
    cut(out / "checkpoint-20" / "model.safetensors", 40)  # weights cut short
    (out / "runs").mkdir()  # not a numbered entry: ignored
    found = newest_complete(out, world_size=2)
    assert found.path == out / "checkpoint-10"
    assert [s.split(":")[0] for s in found.skipped] == [f"checkpoint-{n}" for n in (50, 40, 30, 20)]
    assert "trainer_state.json" in found.skipped[0]
    assert "cut short" in found.skipped[1] and "rank(s) 1" in found.skipped[2]


def test_accelerate_states_need_every_ranks_random_states(tmp_path: Path) -> None:
    d = tmp_path / "ckpt" / "step_8"
    d.mkdir(parents=True)
    safetensors(d / "model.safetensors")
    torch_file(d / "optimizer.bin")
    torch_file(d / "random_states_0.pkl")
    assert incomplete(d, world_size=1) is None
    assert incomplete(d, world_size=2) == "no per-rank state of rank(s) 1"
    torch_file(d / "random_states_1.pkl")
    assert incomplete(d, world_size=2) is None
    (d / "empty.json").write_text("")
    assert incomplete(d, world_size=2) == "empty.json is empty"


def test_a_trainer_state_of_another_step_is_not_that_checkpoint(tmp_path: Path) -> None:
    d = hf_checkpoint(tmp_path, 20)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 19}))
    assert incomplete(d, world_size=2) == "trainer_state.json says global_step 19"
    (d / "trainer_state.json").write_text('{"global_step": 2')
    assert incomplete(d, world_size=2) == "trainer_state.json is not whole JSON"


def test_expand_fills_in_the_path_or_leaves_the_argument_out(tmp_path: Path) -> None:
    argv = ["python", "train.py", "--resume_from_checkpoint={resume:out}", "--max_steps", "30"]
    first = expand(argv, cwd=tmp_path, world_size=2)
    assert first.argv == ["python", "train.py", "--max_steps", "30"]
    assert (
        first.said == "{resume:out}: no out yet; '--resume_from_checkpoint={resume:out}' left out"
    )
    hf_checkpoint(tmp_path / "out", 10)
    hf_checkpoint(tmp_path / "out", 20)
    (tmp_path / "out" / "checkpoint-20" / "trainer_state.json").unlink()
    later = expand(argv, cwd=tmp_path, world_size=2)
    assert later.argv[2] == "--resume_from_checkpoint=out/checkpoint-10"
    assert later.said.startswith("{resume:out}: resuming from out/checkpoint-10 (skipped ")
    assert expand(["python", "x.py"], cwd=tmp_path, world_size=1).argv == ["python", "x.py"]


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (["python", "t.py", "--resume_from_checkpoint", "{resume:out}"], "joined to its flag"),
        (["python", "t.py", "--a={resume:x}", "--b={resume:y}"], "2 {resume:DIR} placeholders"),
        (["python", "t.py", "--a={resume:}"], "write the placeholder as {resume:DIR}"),
        (["python", "t.py", "--a={resume:x}{resume:y}"], "write the placeholder as"),
    ],
)
def test_a_placeholder_trainpod_cannot_fill_is_refused_at_submit(
    command: list[str], says: str
) -> None:
    with pytest.raises(ResumeSyntaxError, match=None) as err:
        check_command(command)
    assert says in str(err.value)
    with pytest.raises(ValueError, match="resume"):
        JobSpec(command=command)
    if "joined" in says:
        assert "--resume_from_checkpoint={resume:out}" in str(err.value)


def test_the_agent_fills_in_the_placeholder_when_it_starts_the_ranks(tmp_path: Path) -> None:
    """The launcher starts each rank with the filled-in argv and says so in its log."""
    hf_checkpoint(tmp_path / "out", 10)
    launcher = Launcher(node_env={}, on_change=lambda: None)
    code = "import sys; print('argv', sys.argv[1:])"
    order = LaunchOrder(
        attempt_id=1,
        job_id=1,
        attempt_number=2,
        argv=[sys.executable, "-c", code, "--resume_from_checkpoint={resume:out}", "--x"],
        workdir=str(tmp_path),
        env={"WORLD_SIZE": "2"},
        ranks=[RankSlot(rank=r, local_rank=r) for r in range(2)],
        log_dir=str(tmp_path / "attempt-2"),
    )
    assert launcher.launch(order)
    wait_until(
        lambda: all(r.state == "exited" for r in launcher.reports()[0].ranks), what="both ranks"
    )
    for rank in (0, 1):
        log = (tmp_path / "attempt-2" / f"rank-{rank}.log").read_text().splitlines()
        assert log == [
            "trainpod: {resume:out}: resuming from out/checkpoint-10",
            "argv ['--resume_from_checkpoint=out/checkpoint-10', '--x']",
        ]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group
def test_a_dcp_checkpoint_without_its_metadata_is_not_complete(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    for step in (2, 4):
        dcp.save(
            {"w": torch.arange(8.0), "step": step}, checkpoint_id=tmp_path / f"iter_{step:07d}"
        )
    newest = tmp_path / "iter_0000004"
    assert incomplete(newest) is None
    (newest / ".metadata").unlink()  # a rank killed before the coordinator's last write
    assert incomplete(newest) == (
        "its DCP shards (*.distcp) have no .metadata (torch.distributed.checkpoint writes it "
        "last, after every rank's shards)"
    )
    found = newest_complete(tmp_path)
    assert found.path == tmp_path / "iter_0000002" and found.skipped[0].startswith("iter_0000004")
