"""A full or read-only memory tier during a save, on a real 1 MiB tmpfs (real ENOSPC and
EROFS, no mock of ``os.write``): the step goes to scratch, with the reason; what memory had
committed stays; when no tier can take it the error names every tier and its free space,
and training (the next save) goes on. Skipped where mounting a tmpfs is not allowed."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainpod.ckpt import Checkpointer
from trainpod.ckpt.fullness import unwritable
from trainpod.ckpt.tiers import FsTier
from trainpod.testing.tmpfs import TmpfsUnavailable, remount_read_only, tmpfs

TRAINPOD_VARS = [
    "TRAINPOD_CHECKPOINT_URI", "TRAINPOD_CHECKPOINT_DIR", "TRAINPOD_SCRATCH_DIR",
    "TRAINPOD_JOB_SCRATCH_DIR", "TRAINPOD_NODE", "TRAINPOD_NODES", "TRAINPOD_JOB_ID",
    "TRAINPOD_ATTEMPT", "TRAINPOD_CKPT_SOCKET", "TRAINPOD_BEACON_SOCKET", "TRAINPOD_ATTEMPT_ID",
]  # fmt: skip
BIG = 1024 * 1024  # floats: 4 MiB, four times the memory tier


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in TRAINPOD_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs as the memory tier's root."""
    try:
        with tmpfs(tmp_path / "shm", "1m") as mnt:
            yield mnt
    except TmpfsUnavailable as exc:
        pytest.skip(str(exc))


class Hook:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def __call__(self, event: str, step: int) -> None:
        self.events.append((event, step))


def checkpointer(root: Path, shm: Path, hook: Hook | None = None, **kw: Any) -> Checkpointer:
    return Checkpointer(
        dir=root / "durable",
        memory=shm,
        scratch_dir=kw.pop("scratch_dir", root / "scratch"),
        every=1,
        agent=False,
        on_event=hook,
        **kw,
    )


def committed(tier_root: Path, step: int) -> bool:
    return any(tier_root.glob(f"**/step-{step:010d}/manifest.json"))


def partial(tier_root: Path, step: int) -> list[Path]:
    return list(tier_root.glob(f"**/step-{step:010d}"))


def test_a_step_too_big_for_shm_goes_to_scratch_and_memory_keeps_its_step(
    tmp_path: Path, shm: Path
) -> None:
    hook = Hook()
    with checkpointer(tmp_path, shm, hook) as ck:
        ck.save(1, {"w": torch.ones(1000)})  # 4 KB: fits
        assert ck.wait(30)
        ck.save(2, {"w": torch.full((BIG,), 2.0)})  # 4 MiB: the pre-check sends it on
        assert ck.wait(30)
        p = ck.progress()
        assert p.committed["memory"] == 1 and p.committed["scratch"] == 2, p.committed
        assert p.committed["durable"] == 2, p
        why = p.errors["memory"]
        assert "step 2: memory (" in why and "ENOSPC" in why and "written to scratch" in why
        assert f"needed {BIG * 4} bytes" in why, why
        assert ("full:memory", 2) in hook.events and ("committed:scratch", 2) in hook.events
        assert ("committed:memory", 2) not in hook.events
        assert committed(shm, 1), "what memory had committed stays"
        assert partial(shm, 2) == [], "no partial file of step 2 in the full tier"
        assert ck.close(30, release_memory=False)
    state = {"w": torch.zeros(BIG)}
    with checkpointer(tmp_path, shm) as ck:
        assert ck.load_latest(state) == 2
        assert ck.last_load is not None and ck.last_load.tier == "scratch"
        assert torch.equal(state["w"], torch.full((BIG,), 2.0))
        ck.close(30, release_memory=False)


def test_a_write_that_runs_out_of_space_is_removed_and_redone_in_scratch(
    tmp_path: Path, shm: Path
) -> None:
    # 3 MiB of pickled bytes: not a tensor, so the pre-check does not see it coming and the
    # real write into the 1 MiB tmpfs fails half way with ENOSPC
    blob = bytes(range(256)) * (3 * 4096)
    hook = Hook()
    with checkpointer(tmp_path, shm, hook) as ck:
        ck.save(1, {"blob": blob, "w": torch.ones(8)})
        assert ck.wait(30)
        p = ck.progress()
        assert p.committed["scratch"] == 1 and p.committed["memory"] is None, p
        assert "ENOSPC" in p.errors["memory"], p.errors
        assert partial(shm, 1) == [], "the partial write was removed"
        state: dict[str, Any] = {"blob": b"", "w": torch.zeros(8)}
        assert ck.load_latest(state) == 1 and state["blob"] == blob
        ck.close(30, release_memory=False)


def test_when_no_tier_can_take_it_the_error_names_them_and_saving_goes_on(
    tmp_path: Path, shm: Path
) -> None:
    hook = Hook()
    scratch = shm / "scratch"  # on the same full tmpfs
    with checkpointer(tmp_path, shm, hook, scratch_dir=scratch) as ck:
        ck.save(1, {"w": torch.full((BIG,), 1.0)})
        assert ck.wait(30)
        p = ck.progress()
        err = p.errors["scratch"]
        assert "no node-local tier can take the step" in err, err
        assert "memory (" in err and "scratch (" in err and "free " in err, err
        assert p.committed["memory"] is None and p.committed["scratch"] is None
        assert ("failed:scratch", 1) in hook.events
        ck.save(2, {"w": torch.full((1000,), 2.0)})  # the next save (smaller) lands in memory
        assert ck.wait(30)
        assert ck.progress().committed["memory"] == 2
        ck.close(30, release_memory=False)


def test_a_read_only_memory_tier_sends_the_step_to_scratch(tmp_path: Path, shm: Path) -> None:
    with checkpointer(tmp_path, shm) as ck:
        try:
            remount_read_only(shm)
        except TmpfsUnavailable as exc:
            pytest.skip(str(exc))
        ck.save(1, {"w": torch.ones(8)})
        assert ck.wait(30)
        p = ck.progress()
        assert p.committed["scratch"] == 1 and "EROFS" in p.errors["memory"], p
        ck.close(30, release_memory=False)


def test_an_errno_inside_dcps_exception_is_found(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    tier = FsTier("memory", tmp_path / "m", node="n0")
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    exc = CheckpointException("write", {0: (RuntimeError("wrapped"), [])})
    exc.__context__ = quota
    full = unwritable(tier, exc, 10)
    assert full is not None and full.reason.startswith("EDQUOT"), full
    assert unwritable(tier, RuntimeError("a bug"), 10) is None  # plenty of space: not full
