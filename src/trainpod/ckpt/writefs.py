"""How the writer's ``dcp.save`` writes a step's files: checksummed as written, into files
allocated ahead of time.

Three costs used to follow the write of a step into the memory tier (measured on the 2-core
box with 1.2 GB of state, ADR 0048): a second pass that read every file back to checksum it
(0.33 s), the tmpfs allocating and zeroing every page of the new files during the
write (writing 1.2 GB into a new ``/dev/shm`` file took 0.58 s, into one allocated before
0.26 s; the allocation alone, ``posix_fallocate``, 0.37 s), and ``torch.save`` computing
a zip CRC-32 of every record (0.3 s). So:

* :class:`HashingStream` computes each file's CRC-32C (:data:`~trainpod.ckpt.manifest.HASH`)
  from the bytes as they are written, 1 MiB at a time while they are in the cache. A stream
  that was seeked (DCP does not today) is not trusted: its file is read back as before.
* :func:`tier_filesystem` (DCP's ``FileSystem``, set as ``FileSystemWriter.fs``) opens a
  ``.distcp`` file by renaming a file of the same name out of the tier's ``.prepared``
  directory when one is there, writes over it and truncates it to what was written.
* :func:`prepare` allocates those files for the next step right after a commit, on a
  thread of its own at nice 19 (:class:`Preparer`), while training runs: the allocation
  still costs the CPU it did, but no longer delays the commit, and it yields to training.
  The price is memory: one step's files of this rank stay allocated between saves (what
  the tier held at the peak of every save anyway).
* :func:`zip_crc_off` turns the zip CRC off while DCP writes (the file's CRC-32C covers it).

A prepared file is a fresh inode no reader has opened or linked (the persister hard-links
committed step files, never these), so nothing that reads a step can see it rewritten.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import google_crc32c

log = logging.getLogger(__name__)

PREPARED = ".prepared"
"""The directory of a tier's root that holds the files allocated for the next step."""
DATA_SUFFIX = ".distcp"
"""DCP's data files (``torch.distributed.checkpoint.filesystem.DEFAULT_SUFFIX``)."""
_PIECE = 1 << 20


class HashingStream:
    """A binary file opened for writing whose bytes are checksummed as they go through.

    ``digest`` is the CRC-32C of everything written when the stream only ever appended,
    else None (the caller must read the file back)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._crc = 0
        self._size = 0
        self._appending = True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        for at in range(0, n, _PIECE):
            piece = view[at : at + _PIECE]
            # google-crc32c takes bytes only: a copy of 1 MiB in the cache costs less than
            # reading the file back from memory afterwards.
            self._crc = google_crc32c.extend(self._crc, bytes(piece))
            self._f.write(piece)
        self._size += n
        return n

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        pos = self._f.seek(offset, whence)
        if pos != self._size:
            self._appending = False
        return pos

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        """A no-op: the file is closed by the file system's ``create_stream``."""

    @property
    def size(self) -> int:
        return self._size

    @property
    def digest(self) -> str | None:
        return f"{self._crc:08x}" if self._appending else None


class _Written:
    """The file system :func:`tier_filesystem` builds, less DCP's base class."""

    def __init__(self, prepared: Path | None) -> None:
        self.prepared = prepared
        self.written: dict[str, tuple[int, str]] = {}
        """file name (the path's last part) -> (size, CRC-32C hex), for the files whose
        checksum is known without reading them back."""
        self.reused = 0
        """How many files were written over a prepared one."""
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        p = Path(path)
        if "w" not in mode:
            with p.open(mode) as f:
                yield f
            return
        reused = self._take(p)
        with p.open("r+b" if reused else mode) as f:
            stream = HashingStream(f)
            yield stream
            f.truncate()  # a prepared file may be longer than this step's
        with self._lock:
            self.reused += int(reused)
            if stream.digest is not None:
                self.written[p.name] = (stream.size, stream.digest)
            else:
                self.written.pop(p.name, None)

    def _take(self, p: Path) -> bool:
        """Move this file's prepared twin into place; False when there is none."""
        if self.prepared is None or not p.name.endswith(DATA_SUFFIX):
            return False
        try:
            os.rename(self.prepared / p.name, p)
        except OSError:
            return False
        return True


_CLASS: type[Any] | None = None
_ZIP_LOCK = threading.Lock()
_zip_users = 0
_zip_was = True


@contextmanager
def zip_crc_off() -> Generator[None, None, None]:
    """Inside: ``torch.save`` (which DCP runs per tensor) skips the zip format's own CRC-32
    of each record. It is redundant with the whole file's CRC-32C computed as the bytes are
    written, and it is not free (0.3 s per 1.2 GB here, ADR 0048). The setting is the
    process's: a ``torch.save`` another thread runs meanwhile writes no CRC either, which
    ``torch.load`` reads all the same (``torch.serialization.set_crc32_options``). Nested
    and concurrent uses restore the setting found before the first."""
    import torch.serialization as ser

    global _zip_users, _zip_was
    with _ZIP_LOCK:
        if _zip_users == 0:
            _zip_was = ser.get_crc32_options()
            ser.set_crc32_options(False)
        _zip_users += 1
    try:
        yield
    finally:
        with _ZIP_LOCK:
            _zip_users -= 1
            if _zip_users == 0:
                ser.set_crc32_options(_zip_was)


def tier_filesystem(prepared: Path | None) -> _Written:
    """DCP's local ``FileSystem`` whose writes go through :class:`HashingStream` into
    prepared files (set it as ``FileSystemWriter.fs``). Built on first use: torch is
    imported only by what writes checkpoints."""
    global _CLASS
    if _CLASS is None:
        from torch.distributed.checkpoint.filesystem import FileSystem

        class TierFileSystem(_Written, FileSystem):  # type: ignore[misc]  # untyped base
            def __init__(self, prepared: Path | None) -> None:
                FileSystem.__init__(self)
                _Written.__init__(self, prepared)

        _CLASS = TierFileSystem
    fs: _Written = _CLASS(prepared)
    return fs


_Job = tuple[Path, dict[str, int], "Callable[[], object] | None", "Callable[[], object] | None"]
"""(prepared directory, sizes, then, first): see :meth:`Preparer.request`."""


class Preparer:
    """Runs :func:`prepare` on a thread of its own at the lowest CPU priority (nice 19 for
    this thread alone: Linux keeps a nice value per thread), so that the allocation takes
    the CPU the training loop leaves. The newest request wins; a write that comes before
    its files are ready takes those that are (each appears whole, by a rename) and makes
    the others itself."""

    def __init__(self, nice: int = 19) -> None:
        self.nice = nice
        self._cond = threading.Condition()
        self._job: _Job | None = None
        self._busy = False
        self._stop = False
        self._firsts = 0
        """``first`` callables asked for and not yet run to their end (:meth:`settle`)."""
        self._thread: threading.Thread | None = None

    def request(
        self,
        prepared: Path,
        sizes: Mapping[str, int],
        then: Callable[[], object] | None = None,
        first: Callable[[], object] | None = None,
    ) -> None:
        """Run ``first`` (the writer's housekeeping after a commit: pruning, unmapping), then
        allocate ``sizes`` in ``prepared``, then run ``then`` (the framed file of
        :mod:`trainpod.ckpt.inplace`), all on this thread. A newer request replaces one not
        started, and a closed preparer takes none: ``first`` runs on the caller's thread then,
        so that none is lost."""
        here: Callable[[], object] | None
        with self._cond:
            if first is not None:
                self._firsts += 1
                first = functools.partial(self._run_first, first)
            if self._stop:
                here = first
            else:
                old, self._job = self._job, (prepared, dict(sizes), then, first)
                here = None if old is None else old[3]
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="tp-ckpt-prepare", daemon=True
                    )
                    self._thread.start()
                self._cond.notify_all()
        if here is not None:
            here()

    def _run_first(self, first: Callable[[], object]) -> None:
        try:
            first()
        finally:
            with self._cond:
                self._firsts -= 1
                self._cond.notify_all()

    def settle(self, timeout_s: float | None) -> bool:
        """True once every ``first`` asked for has run (the writer's housekeeping after a
        commit: what :meth:`Pipeline.wait` promises includes it); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._firsts == 0, timeout_s)

    def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is requested or being allocated (tests)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._job is None and not self._busy, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """No more allocations; wait (up to ``timeout_s``) for the one under way and for the
        thread to run the ``first`` of a request it had not started (not on this thread:
        an in-process recovery closes the preparer on the training thread)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        except OSError as exc:
            log.info("the checkpoint preparer keeps its priority: %s", exc)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._job is not None)
                job, self._job = self._job, None
                stop = self._stop
                self._busy = not stop
            if stop:  # closed: only the housekeeping of a request not started yet
                if job is not None and job[3] is not None:
                    try:
                        job[3]()
                    except Exception:
                        log.exception("the checkpoint preparer's housekeeping")
                return
            assert job is not None
            prepared, sizes, then, first = job
            try:
                if first is not None:
                    first()
                with self._cond:
                    if self._stop:  # closed meanwhile: nothing more is allocated
                        continue
                prepare(prepared, sizes)
                if then is not None:
                    then()
            except OSError as exc:  # the tier is full or gone: the next save does without
                log.info("preparing %s: %s", prepared, exc)
            except Exception:  # never let it end silently: log and go on
                log.exception("preparing %s", prepared)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def prepare(prepared: Path, sizes: Mapping[str, int]) -> int:
    """Allocate a file of each size, named as given, in ``prepared`` for the next step's
    write. Returns the bytes newly allocated. A file that cannot be allocated (the tmpfs is
    full) is left out: the next write makes its own, as it would have anyway. The tier's
    directory is not made again if it is gone (the job ended: nothing may be left behind)."""
    done = 0
    try:
        prepared.mkdir(exist_ok=True)
    except OSError as exc:
        log.info("cannot prepare files in %s: %s", prepared, exc)
        return 0
    for name, size in sizes.items():
        final = prepared / name
        try:
            if final.stat().st_size >= size:
                continue
        except OSError:
            pass
        tmp = prepared / f"{name}.tmp"
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            done += size
        except OSError as exc:
            log.info("cannot allocate %d bytes for %s: %s", size, final, exc)
            try:
                tmp.unlink()
            except OSError:
                pass
    return done


def prepared_bytes(prepared: Path) -> int:
    """Bytes held by the prepared files (they are the next step's space: a fullness check
    counts them as free)."""
    total = 0
    try:
        for p in prepared.iterdir():
            try:
                total += p.stat().st_blocks * 512
            except OSError:
                pass
    except OSError:
        return 0
    return total
