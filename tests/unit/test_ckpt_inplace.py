"""Staging into framed files (ADR 0053): the file laid out as ``torch.save`` of each tensor,
the data copied in place, loads through DCP's own reader as if DCP had written it."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import google_crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.unit.test_ckpt_writefs import (
    assert_in_manifest,
    load_from_memory,
    memory_step,
    wait_prepared,
)

from trainpod.ckpt import Checkpointer
from trainpod.ckpt.framing import framing
from trainpod.ckpt.inplace import ALIGN, FramedFile, Layout, inplace_writer
from trainpod.ckpt.manifest import METADATA
from trainpod.ckpt.writefs import PREPARED, tier_filesystem
from trainpod.testing.wait import wait_until

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int64,
    torch.bool,
    torch.uint8,
    torch.complex64,
]


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple),
    seed=st.integers(0, 2**16),
)
def test_framing_around_any_data_is_what_torch_load_reads(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    t = (torch.rand(shape, generator=gen) * 100).to(dtype)
    f = framing(dtype, shape)
    assert f is not None
    assert f.nbytes == t.numel() * t.element_size()
    data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.dim() else _scalar_bytes(t)
    got = torch.load(io.BytesIO(f.head + data + f.tail), weights_only=True)
    assert got.dtype == dtype and got.shape == t.shape
    assert torch.equal(got, t)


def _scalar_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(1).view(torch.uint8).numpy().tobytes())


def test_a_tensor_without_elements_has_no_framing() -> None:
    assert framing(torch.float32, (0, 3)) is None
    layout = Layout.of([(torch.float32, (0,)), (torch.float32, (2,))])
    assert layout.slots[0] is None and layout.slots[1] is not None


def test_every_zip_and_its_data_start_on_64_bytes(tmp_path: Path) -> None:
    layout = Layout.of([(torch.float32, (3, 5)), (torch.int8, (7,)), (torch.float64, (100, 9))])
    offsets = [s.offset for s in layout.slots if s is not None]
    assert offsets == sorted(offsets) and all(o % ALIGN == 0 for o in offsets)
    assert all(s.data_offset % 64 == 0 for s in layout.slots if s is not None)
    ff = FramedFile.create(tmp_path / "__0_m.distcp", layout)
    assert (tmp_path / "__0_m.distcp").stat().st_size == layout.size
    assert not list(tmp_path.glob(".*.tmp"))
    views = ff.tensors()
    assert [tuple(v.shape) for v in views if v is not None] == [(3, 5), (7,), (100, 9)]


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(64, 33, generator=gen),
        "b": torch.randn(33, generator=gen).to(torch.bfloat16),
        "opt": {"count": torch.arange(10), "m": torch.randn(5, 5, generator=gen)},
        "none": torch.zeros(0),
        "step": 7,
        "name": "run-a",
    }


def _tensor_leaves(sd: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(sd, torch.Tensor):
        out.append(sd)
    elif isinstance(sd, dict):
        for v in sd.values():
            _tensor_leaves(v, out)
    return out


def _staged(state: dict[str, Any], ff: FramedFile) -> dict[str, Any]:
    """``state`` copied into ``ff``'s views where it has one, kept as it is elsewhere."""
    views = iter(ff.tensors())

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, torch.Tensor):
            view = next(views)
            if view is None:
                return v.clone()
            view.copy_(v)
            return view
        return v

    staged: dict[str, Any] = walk(state)
    return staged


def _load(d: Path, like: dict[str, Any]) -> dict[str, Any]:
    def empty(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: empty(x) for k, x in v.items()}
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        return v

    out: dict[str, Any] = empty(like)
    out["step"], out["name"] = 0, ""
    dcp.load(out, storage_reader=dcp.FileSystemReader(d), no_dist=True)
    return out


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_staged_in_place_dcp_writes_no_tensor_and_its_reader_loads_every_value(
    tmp_path: Path,
) -> None:
    state = _state()
    leaves = _tensor_leaves(state, [])
    layout = Layout.of([(t.dtype, tuple(t.shape)) for t in leaves])
    prepared, d = tmp_path / ".prepared", tmp_path / "step_1"
    prepared.mkdir()
    d.mkdir()
    ff = FramedFile.create(prepared / "__0_m.distcp", layout)
    staged = _staged(state, ff)
    ff.move_to(d / "__0_m.distcp")
    writer = inplace_writer(d, [ff], sync_files=False)
    fs = tier_filesystem(None)
    writer.fs = fs
    dcp.save(staged, storage_writer=writer, no_dist=True)

    assert writer.in_place == 4  # w, b, count, m; the empty tensor and the values: DCP's
    assert sorted(p.name for p in d.iterdir()) == [METADATA, "__0_0.distcp", "__0_m.distcp"]
    assert "__0_0.distcp" in fs.written  # what DCP wrote went through the hashing fs
    ff.release()
    del staged
    _assert_same(_load(d, state), state)
    crc = google_crc32c.extend(0, (d / "__0_m.distcp").read_bytes())
    assert ff.crc32c() == f"{crc:08x}"


def test_a_tensor_that_fills_no_slot_whole_is_written_as_dcp_writes_it(tmp_path: Path) -> None:
    base = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    layout = Layout.of([(base.dtype, tuple(base.shape))])
    ff = FramedFile.create(tmp_path / "__0_m.distcp", layout)
    (view,) = ff.tensors()
    assert view is not None
    view.copy_(base)
    staged = {"whole": view, "rows": view[:3], "cols": view[:, 1], "copy": base.clone()}
    writer = inplace_writer(tmp_path, [ff], sync_files=False)
    dcp.save(staged, storage_writer=writer, no_dist=True)
    assert writer.in_place == 1
    expect = {"whole": base, "rows": base[:3].clone(), "cols": base[:, 1].clone(), "copy": base}
    got = {k: torch.zeros_like(v) for k, v in expect.items()}
    dcp.load(got, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    _assert_same(got, expect)


def test_what_is_copied_in_after_the_save_changes_the_file_not_a_view_taken_before(
    tmp_path: Path,
) -> None:
    """A framed file is one snapshot's: the Checkpointer never writes into one again once it
    is handed over. What the file holds is what its views hold, byte for byte."""
    layout = Layout.of([(torch.int64, (6,))])
    ff = FramedFile.create(tmp_path / "__0_m.distcp", layout)
    (view,) = ff.tensors()
    assert view is not None
    view.copy_(torch.arange(6))
    slot = layout.slots[0]
    assert slot is not None
    raw = (tmp_path / "__0_m.distcp").read_bytes()
    got = torch.load(io.BytesIO(raw[slot.offset : slot.offset + slot.length]), weights_only=True)
    assert torch.equal(got, torch.arange(6))


def test_a_file_that_cannot_be_made_leaves_nothing_behind(tmp_path: Path) -> None:
    layout = Layout.of([(torch.float32, (4,))])
    with pytest.raises(OSError):
        FramedFile.create(tmp_path / "missing" / "__0_m.distcp", layout)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ through the Checkpointer
def ck_state(seed: float) -> dict[str, Any]:
    return {"a": torch.full((50_000,), seed), "b": torch.arange(1000.0) + seed, "n": int(seed)}


def wait_framed(mem: Path, other_than: Path | None = None) -> Path:
    """Rank 0's framed file for the next save, once the preparer's thread has made it
    (``other_than``: not that one, made for a layout the state no longer has)."""

    def ready() -> Path | None:
        found = (p for p in mem.glob(f"*/*/{PREPARED}/framed-0-*") if p != other_than)
        return next(found, None)

    return wait_until(ready, interval_s=0.01, what=f"a framed file prepared in {mem}")


def save_framed(ck: Checkpointer, mem: Path, step: int, state: dict[str, Any]) -> None:
    """Save ``step`` once a framed file is prepared for it (there is none before the first
    save's commit: that one is staged as before) and wait for its commit."""
    if step > 1:
        wait_framed(mem)
    ck.save(step, state)
    assert ck.wait(30)


def test_from_the_second_save_the_copy_is_the_memory_tier_s_write_each_step_a_new_file(
    tmp_path: Path,
) -> None:
    mem = tmp_path / "shm"
    with Checkpointer(
        dir=tmp_path / "durable", memory=mem, every=1, agent=False, keep={"memory": 1}
    ) as ck:
        ck.save(1, ck_state(1.0))  # no layout known yet: staged and written as before
        assert ck.wait(30)
        assert not (memory_step(mem, 1) / "__0_m.distcp").exists()
        inodes = set()
        held = tmp_path / "held"
        for step in (2, 3, 4):
            ready = wait_framed(mem)
            inode = ready.stat().st_ino
            ck.save(step, ck_state(float(step)))
            assert ck.wait(30)
            d = memory_step(mem, step)
            f = d / "__0_m.distcp"
            assert f.stat().st_ino == inode, "the state was staged into the prepared file"
            assert inode not in inodes, "a file of an earlier step was written again"
            inodes.add(inode)
            assert_in_manifest(f)
            if step == 2:
                os.link(f, held)  # as the persister holds a step it copies
                held_bytes = held.read_bytes()
        assert held.read_bytes() == held_bytes, "step 2's file changed after its commit"
        assert held.stat().st_nlink == 1, "step 2 left memory"
        assert ck.close(30, release_memory=False)
    back = ck_state(0.0)
    load_from_memory(tmp_path, mem, back, 4)
    _assert_same(back, ck_state(4.0))


def test_a_state_whose_layout_changes_stages_as_before_once_then_into_its_new_layout(
    tmp_path: Path,
) -> None:
    """Adam's moments appear after the first optimizer step: the file made for the old
    layout is not used, the next one is made for the new."""
    mem = tmp_path / "shm"
    grown = {**ck_state(0.0), "m": torch.zeros(300)}
    with Checkpointer(dir=tmp_path / "durable", memory=mem, every=1, agent=False) as ck:
        ck.save(1, ck_state(1.0))
        assert ck.wait(30)
        first = wait_framed(mem)
        grown["m"].fill_(2.0)
        ck.save(2, grown)
        assert ck.wait(30)
        assert not (memory_step(mem, 2) / "__0_m.distcp").exists()
        wait_framed(mem, other_than=first)  # the one made for the old layout may linger
        grown["m"].fill_(3.0)
        ck.save(3, grown)
        assert ck.wait(30)
        assert (memory_step(mem, 3) / "__0_m.distcp").exists()
        assert ck.close(30, release_memory=False)
    back = {**ck_state(-1.0), "m": torch.zeros(300)}
    with Checkpointer(dir=tmp_path / "durable", memory=mem, every=1, agent=False) as ck:
        assert ck.load_latest(back) == 3
        ck.close(30)
    assert torch.equal(back["m"], torch.full((300,), 3.0))


def test_without_staging_into_files_no_framed_file_is_made(tmp_path: Path) -> None:
    mem = tmp_path / "shm"
    with Checkpointer(
        dir=tmp_path / "durable", memory=mem, every=1, agent=False, stage_in_files=False
    ) as ck:
        for step in (1, 2, 3):
            ck.save(step, ck_state(float(step)))
            assert ck.wait(30)
            # The preparer ran: DCP's file for the next step is there, and only that.
            wait_until(lambda: list(mem.glob(f"*/*/{PREPARED}/__0_0.distcp")), what="prepared")
        assert not list(mem.glob("*/*/*/__0_m.distcp"))
        assert not list(mem.glob(f"*/*/{PREPARED}/framed-*"))
        ck.close(30)


@pytest.mark.parametrize("shape", [(256, 1024), (512, 1024), (3, 700_001)])
def test_the_framing_of_a_large_tensor_loads_with_any_data(shape: tuple[int, ...]) -> None:
    """1 MiB and more: the data is passed over while torch.save runs, not kept."""
    t = torch.randn(shape)
    f = framing(t.dtype, shape)
    assert f is not None and f.nbytes == t.numel() * 4
    got = torch.load(io.BytesIO(f.head + t.numpy().tobytes() + f.tail), weights_only=True)
    assert torch.equal(got, t)


def test_the_framing_of_a_gigabyte_tensor_takes_no_gigabyte() -> None:
    import psutil

    before = psutil.Process().memory_info().rss
    f = framing(torch.float32, (1 << 28,))  # 1 GiB of data
    grew = psutil.Process().memory_info().rss - before
    assert f is not None and f.nbytes == 1 << 30
    assert len(f.head) + len(f.tail) < 4096
    assert grew < 64 << 20, f"framing a 1 GiB tensor took {grew >> 20} MiB"


def test_tensors_in_lists_go_into_the_file_and_a_tuple_holding_one_keeps_the_old_path(
    tmp_path: Path,
) -> None:
    """DCP walks mappings and lists, and pickles a tuple whole (tensors and all): a tensor
    it pickles is not one of its tensor items, so such a state stages as before."""

    def listed(v: float) -> dict[str, Any]:
        layers = [torch.full((100,), v), {"m": torch.full((7,), v + 1)}, 3, torch.zeros(0)]
        return {"layers": layers, "betas": (0.9, 0.99), "n": int(v)}

    def tupled(v: float) -> dict[str, Any]:
        return {"a": torch.full((100,), v), "pair": (torch.ones(3) * v, 5)}

    for name, make, framed in (("listed", listed, True), ("tupled", tupled, False)):
        mem = tmp_path / name / "shm"
        with Checkpointer(dir=tmp_path / name / "durable", memory=mem, every=1, agent=False) as ck:
            ck.save(1, make(1.0))
            assert ck.wait(30)
            wait_prepared(mem, 1)
            if framed:
                wait_framed(mem)
            ck.save(2, make(2.0))
            assert ck.wait(30)
            assert (memory_step(mem, 2) / "__0_m.distcp").exists() is framed, name
            ck.close(30, release_memory=False)
        back = make(0.0)
        with Checkpointer(dir=tmp_path / name / "durable", memory=mem, every=1, agent=False) as ck:
            assert ck.load_latest(back) == 2
            ck.close(30)
        _assert_same(back, make(2.0))


@pytest.mark.parametrize("madvise_works", [True, False])
def test_populating_a_mapping_changes_no_byte_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, madvise_works: bool
) -> None:
    """Faulting the pages in (madvise, else one write per page of the byte already there)
    leaves the framing and everything else as it was."""
    import mmap

    from trainpod.ckpt import inplace

    if not madvise_works:

        class NoMadvise:
            def madvise(self, *_: Any) -> int:
                return -1

        monkeypatch.setattr(inplace, "_LIBC", NoMadvise())
    data = os.urandom(3 * mmap.PAGESIZE + 123)
    f = tmp_path / "f"
    f.write_bytes(data)
    with f.open("r+b") as fh:
        mm = mmap.mmap(fh.fileno(), len(data), flags=mmap.MAP_SHARED)
    assert inplace.populate(mm) == ("madvise" if madvise_works else "touch")
    assert bytes(mm) == data and f.read_bytes() == data


# ------------------------------------------------------------------ hashing while copying
def _three_slots(tmp_path: Path) -> tuple[FramedFile, list[torch.Tensor]]:
    data = [torch.arange(3000.0), torch.ones(5, 7, dtype=torch.int64), torch.rand(2_000_000)]
    layout = Layout.of([(t.dtype, tuple(t.shape)) for t in data])
    return FramedFile.create(tmp_path / "__0_m.distcp", layout), data


def _file_crc(path: Path) -> str:
    return f"{google_crc32c.value(path.read_bytes()):08x}"


def test_a_file_checksummed_as_it_fills_has_the_checksum_of_its_bytes(tmp_path: Path) -> None:
    ff, data = _three_slots(tmp_path)
    views = ff.tensors()
    for i, (view, t) in enumerate(zip(views, data, strict=True)):
        assert view is not None
        flat, src = view.view(-1), t.view(-1)
        half = src.numel() // 2
        flat[:half].copy_(src[:half])
        ff.filled(i, half * t.element_size())  # part of a slot: the mark moves into it
        flat[half:].copy_(src[half:])
        ff.filled(i)
    ff.filled()
    assert ff._checksum is not None, "the checksum ran beside the copy (native library found)"
    assert ff.crc32c() == _file_crc(ff.path)
    ff.release()


def test_a_fill_that_stopped_short_is_checksummed_from_the_file(tmp_path: Path) -> None:
    ff, data = _three_slots(tmp_path)
    views = ff.tensors()
    for view, t in zip(views, data, strict=True):
        assert view is not None
        view.copy_(t)
    ff.filled(0)  # the mark stops after the first slot: the thread's value is not the file's
    assert ff.crc32c() == _file_crc(ff.path)
    ff.release()


def test_a_file_let_go_mid_fill_stops_its_checksum_thread(tmp_path: Path) -> None:
    ff, _ = _three_slots(tmp_path)
    ff.filled(0)
    checksum = ff._checksum
    assert checksum is not None
    ff.release()
    checksum._thread.join(30)
    assert not checksum._thread.is_alive()


def test_a_large_tensor_is_staged_in_pieces_and_its_step_s_checksum_holds(tmp_path: Path) -> None:
    """A tensor over the stager's piece (4 MiB) is copied piece by piece, the checksum's
    mark moving after each; the committed file's manifest entry is its bytes' checksum."""
    mem = tmp_path / "shm"

    def state(seed: float) -> dict[str, Any]:
        return {"big": torch.full((3_000_000,), seed), "small": torch.arange(10.0) + seed}

    with Checkpointer(
        dir=tmp_path / "durable", memory=mem, every=1, agent=False, keep={"memory": 1}
    ) as ck:
        for step in (1, 2):
            save_framed(ck, mem, step, state(float(step)))
        f = memory_step(mem, 2) / "__0_m.distcp"
        assert f.exists(), "step 2 was staged into the prepared file"
        assert_in_manifest(f)
        assert ck.close(30, release_memory=False)
    back = state(0.0)
    load_from_memory(tmp_path, mem, back, 2)
    _assert_same(back, state(2.0))
