"""A memory tier's framed file written over again once its step has left the tier (ADR 0055):
salvaged by the prune, taken back only when nothing else holds it."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.unit.test_ckpt_inplace import _assert_same, ck_state, save_framed
from tests.unit.test_ckpt_persist import STEP, make_memory, persister, request
from tests.unit.test_ckpt_writefs import assert_in_manifest, load_from_memory, memory_step

from trainpod.ckpt import Checkpointer
from trainpod.ckpt.filecopy import read_locked
from trainpod.ckpt.inplace import RECYCLED, FramedFile, Layout, salvage
from trainpod.ckpt.manifest import MANIFEST
from trainpod.ckpt.tiers import FsTier, Meter, step_name
from trainpod.ckpt.writefs import PREPARED


def _layout(n: int = 3000) -> Layout:
    return Layout.of([(torch.float32, (n,)), (torch.int64, (7,))])


def _filled(path: Path, layout: Layout, value: float) -> FramedFile:
    ff = FramedFile.create(path, layout)
    a, b = ff.tensors()
    assert a is not None and b is not None
    a.fill_(value)
    b.fill_(int(value))
    return ff


def _framed_mappings() -> int:
    """How many mappings of a framed file this process has (``/proc/self/maps``)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return sum(1 for line in lines if "framed-" in line or "_m.distcp" in line)


def test_the_save_after_next_writes_over_the_file_of_the_step_that_left_memory(
    tmp_path: Path,
) -> None:
    """keep=1: step N's commit drops step N-1, whose file step N+1 is then staged into.
    Every step still loads, each file is in its manifest, and no mapping is left behind."""
    mem = tmp_path / "shm"
    with Checkpointer(
        dir=tmp_path / "durable", memory=mem, every=1, agent=False, keep={"memory": 1}
    ) as ck:
        inode: dict[int, int] = {}
        for step in range(1, 8):
            save_framed(ck, mem, step, ck_state(float(step)))
            if step == 1:
                continue
            f = memory_step(mem, step) / "__0_m.distcp"
            inode[step] = f.stat().st_ino
            assert_in_manifest(f)  # its bytes are what the manifest says they are
        for step in range(4, 8):
            assert inode[step] == inode[step - 2], f"step {step} did not take step {step - 2}'s"
        assert _framed_mappings() <= 3  # the step's, the one kept to salvage, the next one's
        assert ck.close(30, release_memory=False)
    assert _framed_mappings() == 0
    assert not list(mem.rglob(f"{RECYCLED}*")), "closing let the salvaged file go"
    back = ck_state(0.0)
    load_from_memory(tmp_path, mem, back, 7)
    _assert_same(back, ck_state(7.0))


def test_a_file_a_reader_holds_by_name_is_not_written_over(tmp_path: Path) -> None:
    """A persister that reads a step in place (no hard link of its own) holds a shared lock:
    the step's file, salvaged meanwhile, is left to it and the next save gets a new one."""
    mem = tmp_path / "shm"
    with Checkpointer(
        dir=tmp_path / "durable", memory=mem, every=1, agent=False, keep={"memory": 1}
    ) as ck:
        for step in (1, 2):
            save_framed(ck, mem, step, ck_state(float(step)))
        f2 = memory_step(mem, 2) / "__0_m.distcp"
        with read_locked([f2]), f2.open("rb") as held:
            before = held.read()
            old = os.fstat(held.fileno()).st_ino
            for step in (3, 4):
                save_framed(ck, mem, step, ck_state(float(step)))
            assert ck.wait(30)
            new = (memory_step(mem, 4) / "__0_m.distcp").stat().st_ino
            held.seek(0)
            assert held.read() == before, "a file a reader held was written over"
        assert new != old
        assert ck.close(30, release_memory=False)
    back = ck_state(0.0)
    load_from_memory(tmp_path, mem, back, 4)
    _assert_same(back, ck_state(4.0))


def test_a_file_of_another_size_is_not_taken_and_goes(tmp_path: Path) -> None:
    old = tmp_path / "old"
    _filled(old, _layout(1000), 1.0).release()
    assert FramedFile.reuse(old, tmp_path / "new", _layout(2000)) is None
    assert not old.exists() and not (tmp_path / "new").exists()
    assert not list(tmp_path.iterdir()), "nothing left behind"


def test_a_file_with_another_link_is_not_taken_and_the_link_keeps_its_bytes(
    tmp_path: Path,
) -> None:
    layout = _layout()
    old = tmp_path / "old"
    _filled(old, layout, 3.0).release()
    os.link(old, tmp_path / "staged")  # as a persister's staging holds a step
    before = (tmp_path / "staged").read_bytes()
    assert FramedFile.reuse(old, tmp_path / "new", layout) is None
    assert not old.exists() and not (tmp_path / "new").exists()
    assert (tmp_path / "staged").read_bytes() == before


def test_a_file_taken_back_has_its_framing_and_the_same_pages(tmp_path: Path) -> None:
    """Taken back with its old mapping or with a new one, the file reads as a new one of
    its layout once its tensors are filled."""
    layout = _layout()
    for keep_mapping in (True, False):
        old = tmp_path / "old"
        first = _filled(old, layout, 5.0)
        inode = first.inode
        mm = first.kept().mapping if keep_mapping else None
        first.release()
        new = tmp_path / "new"
        ff = FramedFile.reuse(old, new, layout, mm)
        assert ff is not None and ff.path == new and new.stat().st_ino == inode
        assert (ff.mapping is mm) == keep_mapping
        a, b = ff.tensors()
        assert a is not None and b is not None
        a.fill_(6.0)
        b.fill_(6)
        fresh = _filled(tmp_path / "fresh", layout, 6.0)
        assert new.read_bytes() == (tmp_path / "fresh").read_bytes()
        for f in (ff, fresh):
            f.release()
        for p in (new, tmp_path / "fresh"):
            p.unlink()


def test_a_file_taken_back_and_mapped_anew_is_not_left_locked(tmp_path: Path) -> None:
    """The exclusive lock taken to check that no reader holds the file would live on in a
    mapping made from its descriptor and block every later reader (a persister reading the
    committed step in place) until the writer unmapped it."""
    layout = _layout()
    old = tmp_path / "old"
    _filled(old, layout, 1.0).release()
    ff = FramedFile.reuse(old, tmp_path / "new", layout)  # no old mapping: mapped anew
    assert ff is not None and ff.mapping is not None
    with (tmp_path / "new").open("rb") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)  # BlockingIOError if held
    ff.release()


def test_read_locked_holds_a_shared_lock_and_a_name_moved_away_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 10)
    with read_locked([f]), f.open("rb") as other, pytest.raises(BlockingIOError):
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    # Moved away between the open and the lock: the name now holds another file.
    real_flock = fcntl.flock

    def move_then_lock(fd: int, op: int) -> None:
        os.rename(f, tmp_path / "moved")
        f.write_bytes(b"y")
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", move_then_lock)
    with pytest.raises(FileNotFoundError), read_locked([f]):
        pass


def test_salvage_keeps_one_file_per_rank_and_only_of_steps_leaving_the_tier(
    tmp_path: Path,
) -> None:
    tier = FsTier("memory", str(tmp_path / "mem"), keep=1)
    prepared = tmp_path / "mem" / PREPARED
    for step in (1, 2, 3):
        d = tmp_path / "mem" / step_name(step)
        d.mkdir(parents=True)
        for rank in (0, 1):
            (d / f"__{rank}_m.distcp").write_bytes(f"{rank}@{step}".encode())
        (d / "__0_0.distcp").write_bytes(b"values")
        (d / MANIFEST).write_bytes(b"{}")
    torn = tmp_path / "mem" / step_name(4)  # a save in flight: left alone
    torn.mkdir()
    (torn / "__0_m.distcp").write_bytes(b"in flight")
    salvaged: list[Path] = []

    def record(d: Path) -> int:
        salvaged.append(d)
        return salvage(d, prepared)

    tier.prune(1, (), record)
    assert [d.name for d in salvaged] == [step_name(1), step_name(2)]
    assert sorted(p.name for p in prepared.iterdir()) == [
        f"{RECYCLED}0-{step_name(2)}",
        f"{RECYCLED}1-{step_name(2)}",
    ]
    assert (prepared / f"{RECYCLED}1-{step_name(2)}").read_bytes() == b"1@2"
    assert sorted(p.name for p in (tmp_path / "mem").iterdir()) == sorted(
        [PREPARED, step_name(3), step_name(4)]
    )


def test_a_persister_reading_a_step_in_place_holds_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a staging dir (or where hard links fail) the persister copies from the memory
    tier by name: while it copies, each file is under its shared lock."""
    make_memory(tmp_path / "mem", nodes=("n0",))
    events: list[dict[str, Any]] = []
    p0 = persister(tmp_path, "n0", events)
    p0.staging = None
    src = tmp_path / "mem" / "n0" / step_name(STEP)
    locked: list[bool] = []
    put = FsTier.put

    def put_checking(self: FsTier, step: int, s: Path, names: Any, meter: Meter) -> None:
        assert s == src, "read in place"
        with (s / "__0_0.distcp").open("rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked.append(False)
            except BlockingIOError:
                locked.append(True)
        put(self, step, s, names, meter)

    monkeypatch.setattr(FsTier, "put", put_checking)
    assert p0.round(request(tmp_path, "n0", STEP)) == "done"
    monkeypatch.undo()
    assert locked == [True]
    with (src / "__0_0.distcp").open("rb") as f:  # and let go after
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_two_sources_of_one_rank_never_take_the_same_file(tmp_path: Path) -> None:
    """A re-formed process group's source runs beside the old one's (ADR 0046): the one
    salvaged file goes to one of them, whole."""
    layout = _layout()
    old = tmp_path / "old"
    _filled(old, layout, 1.0).release()
    got: list[FramedFile | None] = []

    def take(name: str) -> None:
        got.append(FramedFile.reuse(old, tmp_path / name, layout))

    threads = [threading.Thread(target=take, args=(f"new{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(g is not None for g in got) <= 1
    for g in got:
        if g is not None:
            g.release()
