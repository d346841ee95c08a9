"""Disk tiers write over the files of the step they pruned (ADR 0056, opt-in:
``reuse_files``): the prune keeps the data files, the next copy takes its own by name, and
nothing a reader or another link holds is written over. Off, every copy makes new files."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import pytest
from tests.unit.test_ckpt_inplace import _assert_same, ck_state, save_framed
from tests.unit.test_ckpt_persist import persister, request
from tests.unit.test_ckpt_writefs import assert_in_manifest, load_from_memory

from trainpod.ckpt import Checkpointer
from trainpod.ckpt.filecopy import copy_file
from trainpod.ckpt.manifest import METADATA, FileEntry, Manifest, digest_of
from trainpod.ckpt.reuse import REUSE, claimed, keep_for_reuse, open_locked
from trainpod.ckpt.tiers import FsTier, Location, step_name

MiB = 1 << 20


def _data(node: str, step: int, size: int) -> bytes:
    seed = f"{node}:{step}:".encode()
    return (seed * (size // len(seed) + 1))[:size]


def make_step(
    root: Path, step: int, nodes: tuple[str, ...] = ("n0",), size: int = MiB + 123
) -> Manifest:
    """Each node's memory tier holds its rank's file of ``size`` bytes (not a multiple of a
    block: the copy's last piece goes through the page cache), .metadata and the manifest."""
    data = {n: _data(n, step, size) for n in nodes}
    meta = f"metadata {step}".encode()
    files = [
        FileEntry(f"__{r}_0.distcp", size, digest_of(data[n]), r, n) for r, n in enumerate(nodes)
    ]
    files.append(FileEntry(METADATA, len(meta), digest_of(meta), None, nodes[0]))
    m = Manifest(step, len(nodes), nodes, tuple(files), "job-x", 1, created=1.0)
    for r, n in enumerate(nodes):
        d = root / "mem" / n / step_name(step)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"__{r}_0.distcp").write_bytes(data[n])
        (d / METADATA).write_bytes(meta)
        (d / "manifest.json").write_bytes(m.to_json())
    return m


def _req(root: Path, node: str, step: int) -> Any:
    return request(
        root,
        node,
        step,
        scratch=str(root / "scratch" / node),
        keep={"scratch": 1, "durable": 1},
        reuse_files=True,
    )


def _file(root: Path, tier: str, step: int, rank: int = 0, node: str = "n0") -> Path:
    base = root / "scratch" / node if tier == "scratch" else root / "durable"
    return base / step_name(step) / f"__{rank}_0.distcp"


def test_the_copy_after_next_writes_over_the_file_the_prune_kept(tmp_path: Path) -> None:
    """keep=1: step N's commit prunes step N-1, whose file step N+1 is copied into. Every
    copy has its step's bytes, a longer or shorter one too, and the job's end leaves no
    kept file behind."""
    p0 = persister(tmp_path, "n0", [])
    inode: dict[tuple[str, int], int] = {}
    sizes = {1: MiB + 123, 2: MiB + 123, 3: MiB + 123, 4: 2 * MiB + 5, 5: MiB // 2 + 7}
    for step, size in sizes.items():
        make_step(tmp_path, step, size=size)
        assert p0.round(_req(tmp_path, "n0", step)) == "done"
        for tier in ("durable", "scratch"):
            f = _file(tmp_path, tier, step)
            assert f.read_bytes() == _data("n0", step, size), f"{tier} step {step}"
            inode[tier, step] = f.stat().st_ino
            assert not _file(tmp_path, tier, step - 1).exists(), "keep=1"
    for tier in ("durable", "scratch"):
        for step in (3, 4, 5):
            assert inode[tier, step] == inode[tier, step - 2], f"{tier}: step {step} is new"
        kept = (tmp_path / "durable" if tier == "durable" else tmp_path / "scratch" / "n0") / REUSE
        assert [p.name for p in kept.iterdir()] == ["__0_0.distcp"]
    p0.finish()
    p0.run(finish_timeout_s=5)
    assert not list(tmp_path.rglob(REUSE)), "the job's end lets the kept files go"


def test_on_a_store_shared_by_nodes_each_takes_back_its_own_files(tmp_path: Path) -> None:
    """The node that commits a step prunes the older one, every node's files of it: each
    node's next copy takes its own by name."""
    nodes = ("n0", "n1")
    p = {n: persister(tmp_path, n, []) for n in nodes}
    inode: dict[tuple[int, int], int] = {}
    for step in (1, 2, 3, 4):
        make_step(tmp_path, step, nodes)
        for n, outcome in (("n0", "waiting"), ("n1", "done")):
            req = request(tmp_path, n, step, keep={"durable": 1}, reuse_files=True)
            assert p[n].round(req) == outcome
        for r, n in enumerate(nodes):
            f = _file(tmp_path, "durable", step, r)
            assert f.read_bytes() == _data(n, step, MiB + 123)
            inode[r, step] = f.stat().st_ino
    for r in (0, 1):
        assert inode[r, 3] == inode[r, 1] and inode[r, 4] == inode[r, 2], f"rank {r}"


def test_off_by_default_every_copy_makes_new_files_and_keeps_none(tmp_path: Path) -> None:
    p0 = persister(tmp_path, "n0", [])
    for step in (1, 2, 3):
        make_step(tmp_path, step)
        req = request(tmp_path, "n0", step, scratch=str(tmp_path / "scratch"), keep={"durable": 1})
        assert p0.round(req) == "done"
        assert not list(tmp_path.rglob(REUSE)), f"step {step}: a file kept to write over"
    assert _file(tmp_path, "durable", 3).read_bytes() == _data("n0", 3, MiB + 123)
    assert not _file(tmp_path, "durable", 2).exists(), "keep=1: pruned and gone"


def test_a_file_a_reader_holds_is_not_written_over(tmp_path: Path) -> None:
    """A step read through its tier (a restart loading it) keeps its bytes while a later
    copy would write over its file: that copy makes a new one."""
    p0 = persister(tmp_path, "n0", [])
    durable = FsTier("durable", tmp_path / "durable")
    for step in (1, 2):
        make_step(tmp_path, step)
        assert p0.round(_req(tmp_path, "n0", step)) == "done"
    loc = Location("durable", 2, str(tmp_path / "durable" / step_name(2)), None)
    with durable.open(loc, "__0_0.distcp") as held:
        old = os.fstat(held.fileno()).st_ino
        for step in (3, 4):  # step 3's commit prunes step 2, step 4's copy would take it
            make_step(tmp_path, step)
            assert p0.round(_req(tmp_path, "n0", step)) == "done"
        assert held.read() == _data("n0", 2, MiB + 123), "a file a reader held was written over"
    f4 = _file(tmp_path, "durable", 4)
    assert f4.stat().st_ino != old and f4.read_bytes() == _data("n0", 4, MiB + 123)
    assert not (tmp_path / "durable" / REUSE / "__0_0.distcp").exists() or (
        (tmp_path / "durable" / REUSE / "__0_0.distcp").stat().st_ino != old
    )


def test_a_file_with_another_link_is_not_written_over_and_the_link_keeps_its_bytes(
    tmp_path: Path,
) -> None:
    p0 = persister(tmp_path, "n0", [])
    for step in (1, 2):
        make_step(tmp_path, step)
        assert p0.round(_req(tmp_path, "n0", step)) == "done"
    backup = tmp_path / "backup.distcp"
    os.link(_file(tmp_path, "durable", 2), backup)  # as `cp -al` keeps a step
    for step in (3, 4):
        make_step(tmp_path, step)
        assert p0.round(_req(tmp_path, "n0", step)) == "done"
    assert backup.read_bytes() == _data("n0", 2, MiB + 123)
    assert _file(tmp_path, "durable", 4).stat().st_ino != backup.stat().st_ino


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("old_size", [3 * MiB + 1, MiB // 3, MiB + 4096])
def test_a_copy_over_an_existing_file_is_byte_for_byte_the_source(
    tmp_path: Path, direct: bool, old_size: int
) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(_data("src", 1, MiB + 4096))
    dst.write_bytes(b"\xff" * old_size)
    inode = dst.stat().st_ino
    copy_file(src, dst, MiB + 4096, lambda n: None, sync=True, direct=direct, over=True)
    assert dst.read_bytes() == src.read_bytes() and dst.stat().st_ino == inode


def test_claimed_holds_the_file_exclusively_and_gives_it_up_to_a_reader(tmp_path: Path) -> None:
    reuse, dst = tmp_path / REUSE, tmp_path / "step-2" / "__0_0.distcp"
    dst.parent.mkdir()
    with claimed(reuse, dst) as over:  # nothing kept
        assert not over and not dst.exists()
    old = tmp_path / "step-1"
    old.mkdir()
    (old / "__0_0.distcp").write_bytes(b"old")
    (old / "manifest.json").write_bytes(b"{}")
    assert keep_for_reuse(old, reuse) == 1
    assert [p.name for p in reuse.iterdir()] == ["__0_0.distcp"], "only data files are kept"
    with claimed(reuse, dst) as over:
        assert over and dst.read_bytes() == b"old"
        with dst.open("rb") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
    with dst.open("rb") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)  # released
    # A reader holding the kept file: not taken, the name is free for a new file.
    os.rename(dst, reuse / dst.name)
    with open_locked(reuse / dst.name) as reader, claimed(reuse, dst) as over:
        assert not over and not dst.exists() and reader.read() == b"old"


def test_a_failed_copy_lets_the_kept_files_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk: the space kept to write over is given back at once."""
    p0 = persister(tmp_path, "n0", [])
    for step in (1, 2):
        make_step(tmp_path, step)
        assert p0.round(_req(tmp_path, "n0", step)) == "done"
    assert (tmp_path / "durable" / REUSE).exists()

    def full(*args: Any, **kwargs: Any) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("trainpod.ckpt.tiers.copy_file", full)
    make_step(tmp_path, 3)
    assert p0.round(_req(tmp_path, "n0", 3)) == "retry"
    assert not (tmp_path / "durable" / REUSE).exists()
    assert not (tmp_path / "scratch" / "n0" / REUSE).exists()


def test_the_in_process_copies_write_over_too_and_close_lets_the_kept_files_go(
    tmp_path: Path,
) -> None:
    """The copies a worker makes itself (no agent): durable keep=1, every step loads."""
    mem, durable = tmp_path / "shm", tmp_path / "durable"
    with Checkpointer(
        dir=durable, memory=mem, every=1, agent=False, keep={"durable": 1}, reuse_files=True
    ) as ck:
        inode = {}
        for step in range(1, 6):
            save_framed(ck, mem, step, ck_state(float(step)))  # the first is not framed (_m)
            files = list((durable / step_name(step)).glob("*.distcp"))
            assert files
            for f in files:
                assert_in_manifest(f)  # its bytes are what the manifest says they are
            inode[step] = {f.name: f.stat().st_ino for f in files}
        for step in (4, 5):
            assert inode[step] == inode[step - 2], f"step {step} was copied into new files"
        assert ck.close(30, release_memory=False)
    assert not list(tmp_path.rglob(REUSE))
    back = ck_state(0.0)
    load_from_memory(tmp_path, mem, back, 5)
    _assert_same(back, ck_state(5.0))


def test_on_a_mount_without_locks_readers_read_and_nothing_is_written_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS mounted with ``nolock`` refuses ``flock`` (ENOLCK): a load still reads, and a copy
    makes a new file, since it cannot know that no reader holds the old one."""

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    f = tmp_path / "f.distcp"
    f.write_bytes(b"bytes")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with open_locked(f) as r:
        assert r.read() == b"bytes"
    reuse = tmp_path / REUSE
    reuse.mkdir()
    os.rename(f, reuse / f.name)
    with claimed(reuse, tmp_path / f.name) as over:
        assert not over and not (tmp_path / f.name).exists()

    def io_error(fd: int, op: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fcntl, "flock", io_error)
    (tmp_path / "g").write_bytes(b"x")
    with pytest.raises(OSError, match="Input/output"):  # any other error is not swallowed
        open_locked(tmp_path / "g")
