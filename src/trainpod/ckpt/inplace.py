"""Staging straight into the memory tier's files: the snapshot's copy *is* the write.

Today's memory tier costs two copies of the state after ``save()``: the stall copies it into
staging buffers, and the writer's ``dcp.save`` copies it again into ``/dev/shm`` files
(wrapped by ``torch.save``'s zip framing, one record per tensor). This module removes the
second copy (ADR 0053):

* :func:`~trainpod.ckpt.framing.framing` gives the bytes ``torch.save`` writes around a
  contiguous tensor's data (the zip headers, the pickled tensor, the central directory),
  with the zip CRCs off, computed once per dtype and shape by ``torch.save`` itself.
* :class:`FramedFile` is one file laid out as ``torch.save`` of each tensor, one after the
  other at 64-byte aligned offsets, the framing already in place and the data regions
  allocated but unwritten, mapped into memory, every page faulted in before a save needs
  it (:func:`populate`). :meth:`FramedFile.tensors` are tensors over those
  data regions: the stall copies the training state into them, and once it has, the file
  is each tensor's ``torch.save`` bytes.
* :func:`inplace_writer` is DCP's ``FileSystemWriter`` that, for a tensor already in such
  a file, writes nothing: it records where it lies (file, offset, length), which is what
  DCP's ``.metadata`` holds for every item. Anything else (bytes, a tensor not in the file)
  is written as DCP writes it. DCP's own ``FileSystemReader`` loads the result: it reads
  each item's bytes at that offset and ``torch.load``\\ s them.

The commit then costs a CRC-32C pass over the file (in memory, no copy to disk), DCP's
metadata and the manifest, instead of a second write of every byte.

One file serves one snapshot: once its step is committed it is a checkpoint and must never
be written again, so each save takes a new file (prepared between saves, as ADR 0048's
files are), and nothing keeps a file's tensors once it has been handed to the writer.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import mmap
import os
import re
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from trainpod.ckpt.crc import extend_buffer, native
from trainpod.ckpt.framing import Framing, framing

if TYPE_CHECKING:
    import torch

ALIGN = 64
"""Each tensor's zip starts at a multiple of this in a framed file: its data, which
``torch.save`` aligns to 64 bytes inside the zip, then lies aligned for any dtype (the
mapping starts on a page). Not a page each: a model of many small tensors would double
their bytes."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor's ``torch.save`` bytes lie in a framed file."""

    offset: int
    """Where its zip starts (a multiple of :data:`ALIGN`)."""
    framing: Framing
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def data_offset(self) -> int:
        return self.offset + len(self.framing.head)

    @property
    def length(self) -> int:
        return self.framing.size


@dataclass(frozen=True)
class Layout:
    """The slots of a framed file, in the order of the specs it was made from."""

    slots: tuple[Slot | None, ...]
    """One per spec; None where the tensor has no framing (:func:`framing`)."""
    size: int

    @classmethod
    def of(cls, specs: Sequence[tuple[torch.dtype, Sequence[int]]]) -> Layout:
        """``specs``: (dtype, shape) of each tensor to place, in order."""
        slots: list[Slot | None] = []
        at = 0
        for dtype, shape in specs:
            f = framing(dtype, shape)
            if f is None:
                slots.append(None)
                continue
            slots.append(Slot(at, f, dtype, tuple(int(n) for n in shape)))
            at += -(-f.size // ALIGN) * ALIGN
        return cls(tuple(slots), at)

    @functools.cached_property
    def ends(self) -> tuple[int, ...]:
        """Per slot, where the bytes it makes final end: the next slot's start (its padding
        and the tail of its framing included), or the file's end."""
        out, end = [], self.size
        for slot in reversed(self.slots):
            out.append(end)
            if slot is not None:
                end = slot.offset
        return tuple(reversed(out))

    @property
    def nbytes(self) -> int:
        """The tensors' data in the file."""
        return sum(s.framing.nbytes for s in self.slots if s is not None)


class FramedFile:
    """A file of :class:`Layout`, mapped for writing the tensors' data in place.

    Make it with :meth:`create` (allocates every page, writes the framing, maps it);
    :meth:`tensors` are views of the data regions; :meth:`locate` says where a tensor given
    to DCP lies in the file, if it is one of those views; :meth:`crc32c` checksums it."""

    def __init__(
        self, path: Path, layout: Layout, mm: mmap.mmap | None, inode: int | None = None
    ) -> None:
        self.path = path
        self.layout = layout
        self._mm = mm
        self.inode = inode
        """The file's inode number (None: not known): which salvaged file it is."""
        self._views: list[torch.Tensor | None] | None = None
        self._by_ptr: dict[int, Slot] = {}
        self._checksum: _Checksum | None = None

    @classmethod
    def create(cls, path: Path, layout: Layout) -> FramedFile:
        """Write ``layout``'s framing into a new file at ``path`` (it appears whole, by a
        rename), every page allocated, and map it, every page faulted in (:func:`populate`).
        Raises OSError (the tmpfs is full: ENOSPC)."""
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        if layout.size:
            try:
                os.posix_fallocate(fd, 0, layout.size)
            except BaseException:
                _close_and_remove(fd, tmp)
                raise
        return cls._framed(fd, tmp, path, layout)

    @classmethod
    def reuse(
        cls, old: Path, path: Path, layout: Layout, mm: mmap.mmap | None = None
    ) -> FramedFile | None:
        """``old``, a framed file of a step that left the tier (:func:`salvage`), made a file
        of ``layout`` at ``path`` as :meth:`create` makes one, without allocating a page:
        its pages are written over. ``mm``: this process's mapping of ``old`` still, which
        is used as it is (no page to map again). None (and ``old`` gone) when it may not
        be: another size, another hard link to it (a persister copying that step), or a
        reader holding it (:func:`~trainpod.ckpt.filecopy.read_locked`). Raises OSError as
        :meth:`create` does (``old`` gone then too)."""
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            os.rename(old, tmp)  # taken: whoever opens ``old`` by name from now on finds none
            fd = os.open(tmp, os.O_RDWR)
        except OSError:
            _remove(old)
            _remove(tmp)
            return None
        try:
            st = os.fstat(fd)
            free = st.st_size == layout.size > 0 and st.st_nlink == 1
            if free:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if a reader holds it
        except BlockingIOError:
            free = False
        except BaseException:
            _close_and_remove(fd, tmp)
            raise
        if not free:
            _close_and_remove(fd, tmp)  # a reader's link or open file keeps its bytes
            return None
        if mm is not None and len(mm) != layout.size:
            mm = None
        return cls._framed(fd, tmp, path, layout, mm)

    @classmethod
    def _framed(
        cls, fd: int, tmp: Path, path: Path, layout: Layout, mm: mmap.mmap | None = None
    ) -> FramedFile:
        """Write the framing into the file ``fd`` (at ``tmp``, allocated), map it (unless
        ``mm`` maps it already), fault it in and rename it to ``path``; ``fd`` is closed
        (the mapping keeps the pages)."""
        try:
            inode = os.fstat(fd).st_ino
            for slot in layout.slots:
                if slot is None:
                    continue
                os.pwrite(fd, slot.framing.head, slot.offset)
                os.pwrite(fd, slot.framing.tail, slot.data_offset + slot.framing.nbytes)
            if mm is None and layout.size:
                mm = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED)
                populate(mm)
            os.rename(tmp, path)
            # A lock taken by :meth:`reuse` would outlive ``fd`` in a mapping made from it
            # (the mapping holds the open file), and block every reader of the committed
            # step until it is unmapped: the file is at its new name now, not yet in a
            # committed step, so no reader can open it before it is written.
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            _close_and_remove(fd, tmp)
            raise
        os.close(fd)
        return cls(path, layout, mm, inode)

    def kept(self) -> FramedFile:
        """This file as the writer keeps it once its step is committed: its mapping, not its
        tensors (:meth:`release`), for :meth:`FramedSource.retire`."""
        self.release()
        return FramedFile(self.path, self.layout, self._mm, self.inode)

    @property
    def mapping(self) -> mmap.mmap | None:
        return self._mm

    def tensors(self) -> list[torch.Tensor | None]:
        """One tensor per slot of the layout (None where it has none), over the file's data
        regions: what is copied into them is in the file."""
        import torch

        if self._views is None:
            mm = self._mm
            views: list[torch.Tensor | None] = []
            for slot in self.layout.slots:
                if slot is None:
                    views.append(None)
                    continue
                assert mm is not None  # a slot means a non-empty file
                numel = slot.framing.nbytes // slot.dtype.itemsize
                t = torch.frombuffer(
                    mm, dtype=slot.dtype, count=numel, offset=slot.data_offset
                ).view(slot.shape)
                self._by_ptr[t.data_ptr()] = slot
                views.append(t)
            self._views = views
        return self._views

    def locate(self, t: Any) -> Slot | None:
        """The slot ``t`` fills exactly (a whole view of :meth:`tensors`), else None."""
        import torch

        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not self._by_ptr:
            return None
        slot = self._by_ptr.get(t.data_ptr())
        if slot is None or t.dtype != slot.dtype or tuple(t.shape) != slot.shape:
            return None
        if not t.is_contiguous() or t.untyped_storage().nbytes() != slot.framing.nbytes:
            return None
        return slot

    def move_to(self, path: Path) -> None:
        """Rename the file (the mapping stays valid): into the step's directory."""
        os.rename(self.path, path)
        self.path = path

    def filled(self, index: int | None = None, nbytes: int | None = None) -> None:
        """Slots up to ``index`` of the layout hold their data (None: all of them; with
        ``nbytes``, the slot ``index`` only its first ``nbytes``): the file is final up to
        there. The first call starts checksumming the file on a
        thread of its own, following the copy (hash while copying), where the checksum
        runs without the GIL (:func:`~trainpod.ckpt.crc.native`); else :meth:`crc32c` reads
        the file when asked."""
        if self._mm is None or not native():
            return
        if self._checksum is None:
            self._checksum = _Checksum(self._mm, self.layout.size)
        slot = None if index is None else self.layout.slots[index]
        if slot is not None and nbytes is not None:
            end = slot.data_offset + nbytes  # the first ``nbytes`` of its data
        else:
            end = self.layout.size if index is None else self.layout.ends[index]
        self._checksum.advance(end)

    def crc32c(self) -> str:
        """The whole file's CRC-32C in hex: the one :meth:`filled` had computed while the
        file was filled, else read from the mapping where it lies now."""
        crc = None if self._checksum is None else self._checksum.result()
        if crc is None:
            crc = 0 if self._mm is None else extend_buffer(0, self._mm, 0, self.layout.size)
        return f"{crc:08x}"

    def release(self) -> None:
        """Drop this object's tensors; the mapping goes when no tensor made from it is left
        (a tensor keeps its buffer alive)."""
        self._views = None
        self._by_ptr = {}
        if self._checksum is not None:
            self._checksum.cancel()


class _Checksum:
    """A file's CRC-32C, computed on a thread that follows a mark: the bytes before it are
    final (the stall's copy has passed them). The thread reads the mapping without the GIL
    (:mod:`~trainpod.ckpt.crc`) on the core the training thread's copy leaves."""

    def __init__(self, mm: mmap.mmap, size: int) -> None:
        self._mm, self._size = mm, size
        self._cond = threading.Condition()
        self._mark = 0
        self._cancelled = False
        self._crc: int | None = None
        self._thread = threading.Thread(target=self._run, name="tp-ckpt-crc", daemon=True)
        self._thread.start()

    def advance(self, upto: int) -> None:
        with self._cond:
            self._mark = max(self._mark, min(upto, self._size))
            self._cond.notify_all()

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def result(self) -> int | None:
        """The CRC of the whole file, once the mark has reached its end; None if it was
        cancelled first (or never will: :meth:`advance` did not reach the end)."""
        with self._cond:
            if self._mark < self._size:
                self._cancelled = True
                self._cond.notify_all()
        self._thread.join()
        return self._crc

    def _moved(self, at: int) -> bool:
        return self._cancelled or self._mark > at

    def _run(self) -> None:
        crc, at = 0, 0
        while at < self._size:
            with self._cond:
                self._cond.wait_for(functools.partial(self._moved, at))
                if self._cancelled:
                    return
                upto = self._mark
            crc = extend_buffer(crc, self._mm, at, upto)
            at = upto
        self._crc = crc


_WRITER: type[Any] | None = None


def inplace_writer(path: Path, files: Sequence[FramedFile], *, sync_files: bool) -> Any:
    """DCP's ``FileSystemWriter`` for ``path`` that writes nothing for a tensor already in
    one of ``files`` (which must lie in ``path`` by then): its ``.metadata`` entry points
    at the tensor's ``torch.save`` bytes there. Everything else is written as DCP writes
    it (set ``.fs`` to a file system of :mod:`trainpod.ckpt.writefs` as usual)."""
    global _WRITER
    if _WRITER is None:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
        from torch.distributed.checkpoint.storage import WriteResult
        from torch.futures import Future

        class InPlaceWriter(FileSystemWriter):  # type: ignore[misc]  # untyped base
            def __init__(self, path: Path, files: Sequence[FramedFile], sync_files: bool):
                super().__init__(path, sync_files=sync_files)
                self.framed = list(files)
                self.in_place = 0
                """Items found in place by the last :meth:`write_data`."""
                self.tensors = 0
                """Tensor items in the last plan this rank wrote (after DCP's dedup)."""

            def write_data(
                self, plan: SavePlan, planner: SavePlanner
            ) -> Future[list[WriteResult]]:  # DCP waits on a torch Future
                done: list[WriteResult] = []
                rest = []
                self.tensors = sum(1 for i in plan.items if i.type != WriteItemType.BYTE_IO)
                for item in plan.items:
                    hit = None
                    if item.type != WriteItemType.BYTE_IO:
                        data = planner.resolve_data(item)
                        hit = next(
                            ((f, s) for f in self.framed if (s := f.locate(data)) is not None),
                            None,
                        )
                    if hit is None:
                        rest.append(item)
                        continue
                    f, slot = hit
                    info = _StorageInfo(f.path.name, slot.offset, slot.length)
                    done.append(WriteResult(item.index, slot.length, info))
                self.in_place = len(done)
                if rest:
                    rest_plan = dataclasses.replace(plan, items=rest)
                    done += super().write_data(rest_plan, planner).wait()
                fut: Future[list[WriteResult]] = Future()
                fut.set_result(done)
                return fut

        _WRITER = InPlaceWriter
    return _WRITER(path, files, sync_files)


Spec = tuple["torch.dtype", tuple[int, ...]]
"""(dtype, shape) of one tensor to place."""


def framed_name(rank: int) -> str:
    """A rank's framed file in a step's directory: one of its DCP data files
    (``__<rank>_*.distcp``, :func:`~trainpod.ckpt.manifest.rank_files`), a name DCP's own
    writer never gives (it numbers its files)."""
    return f"__{rank}_m.distcp"


_FRAMED_NAME = re.compile(r"^__(\d+)_m\.distcp$")
RECYCLED = "recycled-"
"""A framed file moved out of a step that left the tier is ``.prepared/recycled-<rank>-<step>``
until that rank's next :meth:`FramedSource.make` takes it (ADR 0055)."""


def salvage(step_dir: Path, prepared: Path) -> int:
    """Before ``step_dir`` (a committed step leaving the tier) is discarded, move its framed
    files into ``prepared`` as ``recycled-<rank>-<step>``, one per rank (an older one goes),
    for that rank's next file to be written over instead of allocated: freeing 1.2 GB of
    tmpfs and allocating it again cost a core for 0.5 s beside the training loop and halved
    the durable copy's speed (measured, ADR 0055). Best effort: what is not moved is
    discarded with its step. How many moved."""
    try:
        names = sorted(p.name for p in step_dir.iterdir())
        prepared.mkdir(exist_ok=True)  # not its parents: a tier gone stays gone
    except OSError:
        return 0
    moved = 0
    for name in names:
        m = _FRAMED_NAME.match(name)
        if m is None:
            continue
        for older in prepared.glob(f"{RECYCLED}{m.group(1)}-*"):
            _remove(older)
        try:
            os.rename(step_dir / name, prepared / f"{RECYCLED}{m.group(1)}-{step_dir.name}")
            moved += 1
        except OSError:
            pass
    return moved


class FramedSource:
    """One rank's supply of framed files in a tier's ``.prepared`` directory.

    The stager asks for a file of its state's layout (:meth:`take`): it gets the one made
    for that layout, once, or None (then it stages as before, and asks for one:
    :meth:`want`). :meth:`make`, run on the preparer's thread after each commit, makes the
    file wanted. :meth:`turn_off` turns staging into files off for good, as when a save showed
    that DCP does not write every tensor this rank stages (replicated tensors are written
    by one rank of those holding them: a file holding them all would fill the tier with
    copies nobody reads)."""

    def __init__(self, prepared: Path, rank: int, salvage_wait_s: float = 0.0) -> None:
        self.prepared = prepared
        self.rank = rank
        self.salvage_wait_s = salvage_wait_s
        """How long :meth:`make` waits for the file of a step leaving the tier, which another
        rank's prune salvages (the node's leader's): 0 where this rank prunes itself."""
        self._due: int | None = None
        """The inode of this rank's file whose step leaves the tier at this commit, if any."""
        self._prefix = f"framed-{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}-"
        """Each source names its files apart: a source of a re-formed process group runs
        beside the old one's, whose last file may wait to be moved (ADR 0046)."""
        self._made = 0
        self._lock = threading.Lock()
        self._ready: FramedFile | None = None
        self._want: tuple[Spec, ...] | None = None
        self._layouts: dict[tuple[Spec, ...], Layout] = {}
        self._retired: list[FramedFile] = []
        """This rank's files of committed steps, newest last, mapped still: when one is
        salvaged, its mapping serves again (no 1.2 GB to unmap, map and fault in)."""
        self.off: str | None = None
        """Why staging into files is off (None: it is on)."""

    def sweep(self) -> int:
        """Remove this rank's files left in ``.prepared`` by processes that are gone (an
        attempt killed between a save and its commit); how many went."""
        gone = 0
        try:
            mine = f"framed-{self.rank}-"
            names = [p for p in self.prepared.iterdir() if p.name.startswith(mine)]
        except OSError:
            return 0
        for p in names:
            pid = p.name.split("-")[2]
            if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
                try:
                    p.unlink()
                    gone += 1
                except OSError:
                    pass
        return gone

    def take(self, specs: Sequence[Spec]) -> FramedFile | None:
        """The file made for ``specs``, handed out once; None when there is none (yet)."""
        key = tuple(specs)
        with self._lock:
            ready = self._ready
            if self.off is not None or ready is None or self._want != key:
                return None
            self._ready = None
        return ready

    def want(self, specs: Sequence[Spec]) -> None:
        """Make the next file for ``specs`` (at the next :meth:`make`)."""
        with self._lock:
            self._want = tuple(specs)

    def wanted(self) -> bool:
        with self._lock:
            return self.off is None and self._want is not None

    def turn_off(self, why: str) -> None:
        """No more files for this run (the first reason is kept); this rank's salvaged
        files go too."""
        with self._lock:
            self.off = self.off or why
            self._drop_locked()
            retired, self._retired = self._retired, []
        for ff in retired:
            ff.release()
        for old in self._salvaged():
            _remove(old)

    def retire(self, ff: FramedFile, keep: int) -> None:
        """``ff``'s step is committed: keep its mapping (not its tensors) while its step may
        still be salvaged, at most ``keep`` files; older ones are let go."""
        with self._lock:
            if self.off is not None:
                ff.release()
                return
            self._retired.append(ff.kept())
            drop, self._retired = self._retired[:-keep], self._retired[-keep:]
            # Full: the oldest kept is of the step the prune now takes out of the tier
            self._due = self._retired[0].inode if len(self._retired) == keep else None
        for old in drop:
            old.release()

    def _salvaged(self) -> list[Path]:
        """This rank's files :func:`salvage` moved here, the newest step's first."""
        try:
            found = list(self.prepared.glob(f"{RECYCLED}{self.rank}-*"))
        except OSError:
            return []
        return sorted(found, key=lambda p: _step_of(p.name), reverse=True)

    def _reused(self, path: Path, layout: Layout) -> FramedFile | None:
        """A salvaged file of this rank made the file at ``path`` (:meth:`FramedFile.reuse`),
        else None; the others go."""
        with self._lock:
            due, self._due = self._due, None
        found = self._salvaged()
        if not found and due is not None and self.salvage_wait_s > 0:
            deadline = time.monotonic() + self.salvage_wait_s  # the leader's prune: soon
            while not found and time.monotonic() < deadline:
                time.sleep(0.01)
                found = self._salvaged()
        got = None
        for old in found:
            if got is not None:
                _remove(old)
                continue
            mm = None
            try:
                inode = old.stat().st_ino
            except OSError:
                continue
            with self._lock:
                for i, ff in enumerate(self._retired):
                    if ff.inode == inode:
                        mm = ff.mapping if ff.layout == layout else None
                        del self._retired[i]
                        break
            try:
                got = FramedFile.reuse(old, path, layout, mm)
            except OSError:
                got = None
        return got

    def make(self) -> FramedFile | None:
        """Make the file wanted, unless one for it is ready (the preparer's thread). Raises
        OSError (the tier is full: the next save stages as before)."""
        with self._lock:
            key = self._want
            if self.off is not None or key is None:
                return None
            if self._ready is not None and self._ready.layout is self._layouts.get(key):
                return self._ready
            self._drop_locked()
            layout = self._layouts.get(key)
        if layout is None:
            layout = Layout.of(key)
        # A name of its own: a file taken by the last save waits here until the writer
        # moves it into its step's directory.
        self.prepared.mkdir(exist_ok=True)  # not its parents: a tier gone stays gone
        if self._made == 0:
            self.sweep()
        self._made += 1
        path = self.prepared / f"{self._prefix}{self._made}"
        ff = self._reused(path, layout) or FramedFile.create(path, layout)
        with self._lock:
            self._layouts = {key: layout}  # the layouts of states no longer saved go
            if self.off is not None or self._want != key:
                _unlink(ff)
                return None
            self._ready = ff
        return ff

    def close(self) -> None:
        """No more files: the one not taken goes (and one being made goes when it is)."""
        self.turn_off("closed")

    def discard(self, ff: FramedFile) -> None:
        """A file taken but not handed to the writer (the copy into it failed)."""
        _unlink(ff)

    def _drop_locked(self) -> None:
        if self._ready is not None:
            _unlink(self._ready)
            self._ready = None


_MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault a range in, writable, without changing its data."""
_LIBC: Any = None


def populate(mm: mmap.mmap) -> str:
    """Fault every page of the mapping in, writable, so the stall's copy takes no page
    fault (on tmpfs, a page ``posix_fallocate`` allocated is zeroed at its first fault).
    Never under the GIL: ``mmap``'s own ``MAP_POPULATE`` runs inside ``mmap()``, which
    holds it, and stopped a training thread of the same process for the 1.4-3 s the
    faults of 1.2 GB took (measured, ADR 0053). ``madvise(MADV_POPULATE_WRITE)`` through
    ctypes (which lets the GIL go), else one write per page of the bytes already there
    by torch (which lets it go too). Returns which was used."""
    global _LIBC
    size = len(mm)
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    buf = (ctypes.c_char * size).from_buffer(mm)
    try:
        rc = _LIBC.madvise(
            ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), _MADV_POPULATE_WRITE
        )
    finally:
        del buf
    if rc == 0:
        return "madvise"
    import torch

    every = torch.frombuffer(mm, dtype=torch.uint8)[:: mmap.PAGESIZE]
    every.copy_(every.clone())  # the same bytes back: a write fault on every page
    del every
    return "touch"


def _unlink(ff: FramedFile) -> None:
    ff.release()
    _remove(ff.path)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _close_and_remove(fd: int, path: Path) -> None:
    os.close(fd)
    _remove(path)


def _step_of(name: str) -> int:
    """The step of a salvaged file's name (``recycled-<rank>-step-<n>``); -1 if none."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1
