"""The memory tier's write path (ADR 0048): each file's checksum comes from the bytes as
they are written, and a step's files are written over files allocated for them after the
previous commit; a file some reader still holds (the persister's hard link) is never one of
them. The fullness check counts prepared files as free space."""

from __future__ import annotations

import io
import os
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from tests.unit.test_ckpt_tier_full import checkpointer, clean_env, shm

from trainpod.ckpt import Checkpointer
from trainpod.ckpt.manifest import MANIFEST, Manifest, digest_of, hash_file
from trainpod.ckpt.writefs import (
    PREPARED,
    HashingStream,
    Preparer,
    prepare,
    prepared_bytes,
    tier_filesystem,
    zip_crc_off,
)
from trainpod.testing.wait import wait_until

__all__ = ["clean_env", "shm"]  # fixtures


def test_the_stream_checksums_what_it_writes_and_distrusts_a_seek() -> None:
    data = bytes(range(256)) * 9000  # 2.3 MB: several pieces
    out = io.BytesIO()
    s = HashingStream(out)
    s.write(memoryview(data)[:1000])
    s.write(bytearray(data[1000:]))
    assert (s.size, s.digest) == (len(data), digest_of(data))
    assert out.getvalue() == data
    s.seek(10)
    s.write(b"x")
    assert s.digest is None, "bytes written over others: the file must be read back"


def state(seed: float) -> dict[str, Any]:
    return {"a": torch.full((50_000,), seed), "b": torch.arange(1000.0) + seed, "n": int(seed)}


def test_dcp_writes_over_a_prepared_file_and_truncates_it(tmp_path: Path) -> None:
    prepared = tmp_path / PREPARED
    assert prepare(prepared, {"__0_0.distcp": 1 << 20}) == 1 << 20
    inode = (prepared / "__0_0.distcp").stat().st_ino
    fs = tier_filesystem(prepared)
    writer = dcp.FileSystemWriter(tmp_path / "step", sync_files=False)
    writer.fs = fs
    dcp.save(state(3.0), storage_writer=writer, no_dist=True)
    f = tmp_path / "step" / "__0_0.distcp"
    assert f.stat().st_ino == inode and fs.reused == 1
    assert not (prepared / "__0_0.distcp").exists()
    size, digest = hash_file(f)
    assert size < 1 << 20, "the prepared file's tail was cut off"
    assert fs.written["__0_0.distcp"] == (size, digest)
    back = state(0.0)
    dcp.load(back, checkpoint_id=tmp_path / "step", no_dist=True)
    assert torch.equal(back["a"], state(3.0)["a"]) and back["n"] == 3


def wait_prepared(mem: Path, size: int) -> Path:
    """The prepared file of rank 0, once the preparer's thread has allocated it."""

    def ready() -> Path | None:
        found = mem.glob(f"*/*/{PREPARED}/__0_0.distcp")
        return next((f for f in found if f.stat().st_size >= size), None)

    return wait_until(ready, interval_s=0.01, what=f"a file of {size} bytes prepared in {mem}")


def memory_step(root: Path, step: int) -> Path:
    (d,) = root.glob(f"*/*/step-{step:010d}")
    return d


def assert_in_manifest(f: Path) -> None:
    """``f`` is in its step's manifest, with its size and checksum."""
    manifest = Manifest.from_json((f.parent / MANIFEST).read_bytes())
    (entry,) = [e for e in manifest.files if e.name == f.name]
    assert hash_file(f) == (entry.size, entry.digest)


def load_from_memory(root: Path, mem: Path, back: dict[str, Any], step: int) -> None:
    """A new Checkpointer loads ``step`` into ``back``, from the memory tier."""
    with Checkpointer(dir=root / "durable", memory=mem, every=1, agent=False) as ck:
        assert ck.load_latest(back) == step
        assert ck.last_load is not None and ck.last_load.tier == "memory"
        ck.close(30)


def test_each_save_reuses_the_file_prepared_after_the_last_and_never_a_linked_one(
    tmp_path: Path,
) -> None:
    mem = tmp_path / "shm"
    with Checkpointer(
        dir=tmp_path / "durable",
        memory=mem,
        every=1,
        agent=False,
        keep={"memory": 1},
        stage_in_files=False,  # DCP's own write into prepared files (framed ones: 0053)
    ) as ck:
        ck.save(1, state(1.0))
        assert ck.wait(30)
        one = memory_step(mem, 1) / "__0_0.distcp"
        size = one.stat().st_size
        ready = wait_prepared(mem, size)
        assert ready.stat().st_size == size
        held = tmp_path / "held"
        os.link(one, held)  # as the persister holds a step it copies
        held_bytes = held.read_bytes()
        next_inode = ready.stat().st_ino
        for step in (2, 3, 4):
            wait_prepared(mem, size)
            ck.save(step, state(float(step)))
            assert ck.wait(30)
            f = memory_step(mem, step) / "__0_0.distcp"
            if step == 2:
                assert f.stat().st_ino == next_inode, "step 2 went into the prepared file"
            assert_in_manifest(f)
        assert held.read_bytes() == held_bytes, "a linked file of a pruned step was rewritten"
        assert held.stat().st_nlink == 1, "step 1 left memory"
        assert ck.close(30, release_memory=False)
    back = state(0.0)
    load_from_memory(tmp_path, mem, back, 4)
    assert torch.equal(back["a"], state(4.0)["a"]) and back["n"] == 4


def test_prepared_files_count_as_free_space_in_a_full_tmpfs(tmp_path: Path, shm: Path) -> None:
    """1 MiB tmpfs, 0.4 MiB steps, one kept: step + prepared files leave 0.2 MiB free, so
    the next step fits only because its prepared files are counted."""
    big = {"w": torch.zeros(100_000)}  # 400 KB
    with checkpointer(tmp_path, shm, keep={"memory": 1}) as ck:
        for step in (1, 2, 3):
            if step > 1:
                wait_prepared(shm, 400_000)
            big["w"].fill_(step)
            ck.save(step, big)
            assert ck.wait(30)
            p = ck.progress()
            assert p.committed["memory"] == step, (step, p.errors)
        assert prepared_bytes(wait_prepared(shm, 400_000).parent) >= 400_000
        assert ck.close(30, release_memory=False)


def test_a_prepared_file_that_does_not_fit_is_left_out(tmp_path: Path, shm: Path) -> None:
    assert prepare(shm / PREPARED, {"__0_0.distcp": 4 << 20, "__1_0.distcp": 1000}) == 1000
    assert sorted(p.name for p in (shm / PREPARED).iterdir()) == ["__1_0.distcp"]


def test_the_zip_crc_is_off_only_inside_and_what_was_saved_loads() -> None:
    from torch.serialization import get_crc32_options

    assert get_crc32_options()
    buf = io.BytesIO()
    with zip_crc_off():
        with zip_crc_off():
            assert not get_crc32_options()
        assert not get_crc32_options(), "still inside the outer one"
        torch.save(torch.arange(1000.0), buf)
    assert get_crc32_options(), "restored"
    crcs = {i.filename.rsplit("/", 1)[-1]: i.CRC for i in zipfile.ZipFile(buf).infolist()}
    assert crcs["0"] == 0, crcs  # the tensor's bytes: no zip CRC computed
    buf.seek(0)
    assert torch.equal(torch.load(buf), torch.arange(1000.0))


def test_the_preparer_runs_first_before_it_allocates_on_its_own_thread(tmp_path: Path) -> None:
    p = Preparer()
    seen: list[tuple[str, int, bool]] = []
    f = tmp_path / PREPARED / "__0_0.distcp"
    p.request(
        tmp_path / PREPARED,
        {f.name: 4096},
        then=lambda: seen.append(("then", threading.get_ident(), f.exists())),
        first=lambda: seen.append(("first", threading.get_ident(), f.exists())),
    )
    assert p.settle(30)
    assert p.wait_idle(30)
    p.close()
    assert [(what, made) for what, _, made in seen] == [("first", False), ("then", True)]
    assert {ident for _, ident, _ in seen} == {p._thread.ident if p._thread else None}
    assert threading.get_ident() not in {ident for _, ident, _ in seen}


def test_a_request_replaced_before_it_starts_still_runs_its_first(tmp_path: Path) -> None:
    """The newest request wins, but the housekeeping of one it replaced is not lost: it
    runs on the caller's thread; so does one asked of a closed preparer."""
    p = Preparer()
    busy, go = threading.Event(), threading.Event()
    ran: dict[str, int] = {}

    def note(name: str) -> Callable[[], object]:
        return lambda: ran.setdefault(name, threading.get_ident())

    def block() -> None:
        busy.set()
        go.wait(30)

    p.request(tmp_path / PREPARED, {}, first=block)
    assert busy.wait(30)  # the thread is in the first request's housekeeping
    p.request(tmp_path / PREPARED, {}, first=note("second"))  # waits
    assert "second" not in ran
    p.request(tmp_path / PREPARED, {}, first=note("third"))  # replaces the second
    assert ran["second"] == threading.get_ident(), "the replaced one ran here, at once"
    assert not p.settle(0.0), "the first and third have not run yet"
    go.set()
    assert p.settle(30)
    assert ran["third"] != threading.get_ident()
    p.close()
    p.request(tmp_path / PREPARED, {}, first=note("after close"))
    assert ran["after close"] == threading.get_ident()
    assert p.settle(0.0)


def test_a_closed_preparer_runs_the_first_it_had_not_started_on_its_thread(
    tmp_path: Path,
) -> None:
    """close() does not run it on the caller's thread (an in-process recovery closes the
    preparer on the training thread) nor allocate the files of that request."""
    p = Preparer()
    busy, go = threading.Event(), threading.Event()
    ran: dict[str, int] = {}

    def block() -> None:
        busy.set()
        go.wait(30)

    p.request(tmp_path / PREPARED, {}, first=block)
    assert busy.wait(30)
    p.request(
        tmp_path / PREPARED,
        {"__0_0.distcp": 4096},
        first=lambda: ran.setdefault("pending", threading.get_ident()),
    )
    p.close(0)  # returns at once
    assert "pending" not in ran
    go.set()
    assert p.settle(30)
    assert ran["pending"] not in (None, threading.get_ident())
    assert not (tmp_path / PREPARED / "__0_0.distcp").exists(), "nothing allocated after close"


def test_the_preparer_allocates_at_the_lowest_priority_and_stops_on_close(tmp_path: Path) -> None:
    p = Preparer()
    p.request(tmp_path / PREPARED, {"__0_0.distcp": 4096})
    assert p.wait_idle(30)
    assert (tmp_path / PREPARED / "__0_0.distcp").stat().st_size == 4096
    assert p._thread is not None
    nice = os.getpriority(os.PRIO_PROCESS, p._thread.native_id or 0)
    assert nice == 19, "the preparer's thread alone runs at nice 19"
    assert os.getpriority(os.PRIO_PROCESS, 0) < 19, "not the whole process"
    p.close()
    p.request(tmp_path / PREPARED, {"__1_0.distcp": 4096})
    assert not (tmp_path / PREPARED / "__1_0.distcp").exists(), "nothing after close"
    assert not prepare(tmp_path / "gone" / PREPARED, {"__0_0.distcp": 10}), "no dir made again"
    assert not (tmp_path / "gone").exists()
