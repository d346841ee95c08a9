"""Faults in one process: corrupt, truncated, missing and torn copies; a full scratch disk; a
durable store that is unreachable for a while. The right checkpoint is loaded, the reasons
are recorded and saving goes on."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainpod.ckpt import Checkpointer, FsTier
from trainpod.ckpt.fakes import FlakyFileSystem, FullFileSystem
from trainpod.testing.wait import wait_until

TRAINPOD_VARS = [
    "TRAINPOD_CHECKPOINT_URI", "TRAINPOD_CHECKPOINT_DIR", "TRAINPOD_SCRATCH_DIR",
    "TRAINPOD_JOB_SCRATCH_DIR", "TRAINPOD_NODE", "TRAINPOD_NODES", "TRAINPOD_JOB_ID",
    "TRAINPOD_ATTEMPT", "TRAINPOD_CKPT_SOCKET", "TRAINPOD_BEACON_SOCKET", "TRAINPOD_ATTEMPT_ID",
]  # fmt: skip


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in TRAINPOD_VARS:
        monkeypatch.delenv(var, raising=False)


def make_state(seed: float = 0.0) -> dict[str, Any]:
    model = torch.nn.Linear(16, 8)
    with torch.no_grad():
        model.weight.fill_(seed)
    return {"model": model, "t": torch.arange(10.0) + seed, "extra": {"epoch": int(seed)}}


def checkpointer(root: Path, **kw: Any) -> Checkpointer:
    return Checkpointer(
        dir=root / "durable", memory=root / "shm", scratch_dir=root / "scratch", every=1, **kw
    )


def step_dirs(root: Path, step: int) -> dict[str, Path]:
    name = f"step-{step:010d}"
    (mem,) = (root / "shm").glob(f"*/*/{name}")
    (scr,) = (root / "scratch").glob(f"*/*/ckpt/{name}")
    return {"memory": mem, "scratch": scr, "durable": root / "durable" / name}


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[Path]:
    """Steps 1 and 2 committed in memory, scratch and durable, as a run that was killed
    leaves them (a clean close outside trainpod would release the memory tier)."""
    with checkpointer(tmp_path) as ck:
        for step in (1, 2):
            ck.save(step, make_state(step))
            assert ck.wait(30)  # in every tier before the next: else step 1 may be passed over
        assert ck.close(release_memory=False)
    yield tmp_path


def load(root: Path) -> tuple[int | None, str | None, tuple[str, ...], dict[str, Any]]:
    state = make_state(0.0)
    with checkpointer(root) as ck:
        step = ck.load_latest(state)
        assert ck.last_load is not None
        return step, ck.last_load.tier, ck.last_load.reasons, state


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_truncated_file_is_read_from_the_next_tier(saved: Path) -> None:
    shard = step_dirs(saved, 2)["memory"] / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    step, tier, reasons, state = load(saved)
    # .metadata is intact in memory; the shard comes from scratch.
    assert (step, tier) == (2, "memory+scratch")
    assert torch.equal(state["t"], torch.arange(10.0) + 2)
    assert any("step 2" in r and "memory" in r and "truncated" in r for r in reasons), reasons


def test_flipped_bytes_in_two_tiers_fall_back_to_durable(saved: Path) -> None:
    dirs = step_dirs(saved, 2)
    flip_byte(dirs["memory"] / "__0_0.distcp")
    flip_byte(dirs["scratch"] / "__0_0.distcp")
    step, tier, reasons, state = load(saved)
    assert (step, tier) == (2, "memory+durable") and state["extra"] == {"epoch": 2}
    assert sum("crc32c mismatch" in r for r in reasons) == 2, reasons


def test_missing_shard_and_bad_metadata_everywhere_fall_back_to_the_previous_step(
    saved: Path,
) -> None:
    dirs = step_dirs(saved, 2)
    (dirs["memory"] / "__0_0.distcp").unlink()
    flip_byte(dirs["scratch"] / "__0_0.distcp")
    flip_byte(dirs["scratch"] / ".metadata")
    (dirs["durable"] / "__0_0.distcp").write_bytes(b"")
    step, tier, reasons, state = load(saved)
    assert (step, tier) == (1, "memory")
    assert torch.equal(state["model"].weight, torch.full((8, 16), 1.0))
    text = "\n".join(reasons)
    for why in ("missing", "crc32c mismatch", "truncated", "no intact copy of __0_0.distcp"):
        assert why in text, text


def test_torn_checkpoint_without_manifest_is_never_loaded(saved: Path) -> None:
    # A save of step 3 that died after writing its shards: same files, no manifest.
    for tier, d in step_dirs(saved, 2).items():
        torn = d.with_name("step-0000000003")
        shutil.copytree(d, torn)
        (torn / "manifest.json").unlink()
        if tier == "durable":  # and a garbled manifest (a torn write without rename)
            (torn / "manifest.json").write_bytes(b'{"format": "trainpod-ckpt/1", "st')
    got, where, reasons, _ = load(saved)
    assert (got, where) == (2, "memory")
    assert sum("step 3 in" in r and "no manifest" in r for r in reasons) == 2, reasons
    assert any("step 3" in r and "malformed manifest" in r for r in reasons), reasons


def test_state_that_does_not_fit_is_a_reason_not_a_crash(saved: Path) -> None:
    state = make_state()
    state["new"] = torch.zeros(2)  # a key the checkpoints do not have
    with checkpointer(saved) as ck:
        assert ck.load_latest(state) is None
        assert ck.last_load is not None
        assert all("does not fit" in r for r in ck.last_load.reasons), ck.last_load.reasons


def _tiers(root: Path, scratch: FsTier | None = None, durable: FsTier | None = None) -> list[Any]:
    node = "n0"
    mem = FsTier("memory", root / "shm", node=node, sync=False)
    out: list[Any] = [mem]
    if scratch is not None:
        out.append(scratch)
    out.append(durable or FsTier("durable", root / "durable", retry=True, throttled=True))
    return out


def _full_scratch_run(root: Path, scratch: FsTier) -> None:
    with Checkpointer(tiers=_tiers(root, scratch), every=1) as ck:
        for step in (1, 2, 3):  # every save still returns, every scratch copy fails
            ck.save(step, make_state(step))
            assert ck.wait(30)
        p = ck.progress()
        assert p.committed == {"memory": 3, "scratch": None, "durable": 3}
        assert "No space left on device" in p.errors["scratch"], p.errors
        assert "step 3" in p.errors["scratch"]
        state = make_state()
        assert ck.load_latest(state) == 3 and torch.equal(state["t"], torch.arange(10.0) + 3)


def test_full_scratch_disk_is_skipped_and_the_durable_copy_still_lands(tmp_path: Path) -> None:
    scratch = FsTier("scratch", tmp_path / "scratch", fs=FullFileSystem(capacity=4096), node="n0")
    _full_scratch_run(tmp_path, scratch)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (real ENOSPC); skipped where mounting is not allowed."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_tmpfs_scratch_gives_real_enospc(tmp_path: Path, tiny_tmpfs: Path) -> None:
    (tiny_tmpfs / "filler").write_bytes(b"\0" * 60_000)
    _full_scratch_run(tmp_path, FsTier("scratch", tiny_tmpfs / "ckpt", node="n0"))


def test_unreachable_durable_store_is_retried_until_it_recovers(tmp_path: Path) -> None:
    fs = FlakyFileSystem()
    durable = FsTier("durable", str(tmp_path / "durable"), fs=fs, retry=True, throttled=True)
    assert not durable.local  # goes through fsspec, manifest included
    fs.down = True
    with Checkpointer(tiers=_tiers(tmp_path, durable=durable), every=1, retry_base_s=0.05) as ck:
        for step in (1, 2):  # training continues while the store is down
            ck.save(step, make_state(step))
        # Step 2 reaches memory while step 1's durable copy is refused: wait for both.
        p = wait_until(
            lambda: (
                fs.refused >= 3
                and "durable" in (q := ck.progress()).errors
                and q.committed["memory"] == 2
                and q
            ),
            what="step 2 in memory and the durable copy retried",
        )
        assert p.committed["memory"] == 2 and p.committed["durable"] is None
        assert "unreachable" in p.errors["durable"] and p.retry_in_s is not None
        assert not ck.wait(timeout_s=0.2)
        fs.down = False
        assert ck.wait(timeout_s=30)
        p = ck.progress()
        assert p.committed["durable"] == 2 and "durable" not in p.errors
        assert p.bytes_done == p.bytes_total > 0
    assert (tmp_path / "durable" / "step-0000000002" / "manifest.json").exists()
    # The durable copy alone restores the state (memory tier wiped, as on a new node).
    shutil.rmtree(tmp_path / "shm")
    with Checkpointer(tiers=_tiers(tmp_path, durable=durable), every=1) as ck2:
        state = make_state()
        assert ck2.load_latest(state) == 2 and ck2.last_load is not None
        assert ck2.last_load.tier == "durable" and state["extra"] == {"epoch": 2}


def test_bandwidth_cap_slows_only_the_throttled_tiers(tmp_path: Path) -> None:
    big = {"x": torch.zeros(256 * 1024)}  # 1 MiB
    with checkpointer(tmp_path, bandwidth_bps=4 << 20) as ck:
        ck.save(1, big)
        assert ck.wait(30)
        p = ck.progress()
        # durable is throttled to 4 MiB/s: its 1 MiB copy cannot beat the cap by much.
        assert p.committed["durable"] == 1 and p.rate_bps < 4.5 * (1 << 20)


def test_close_gives_up_after_its_timeout_while_the_store_is_down(tmp_path: Path) -> None:
    fs = FlakyFileSystem()
    fs.down = True
    durable = FsTier("durable", str(tmp_path / "durable"), fs=fs, retry=True)
    ck = Checkpointer(tiers=_tiers(tmp_path, durable=durable), every=1, retry_base_s=0.05)
    ck.save(1, make_state(1))
    assert ck.close(timeout_s=0.5) is False  # the copy could not finish: said so, not hung
    assert not ck._pipe._copier.is_alive() and not ck._pipe._writer.is_alive()
    assert ck.progress().committed == {"memory": 1, "durable": None}
