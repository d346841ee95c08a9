"""Checkpoint tiers: where copies of a checkpoint live, behind one small interface.

A :class:`Tier` stores checkpoint directories ``step-<step>/`` (DCP files + ``manifest.json``)
and can say which committed copies this rank can read. Node-scoped tiers hold one node's
part per directory (its ranks' files and ``.metadata``); global tiers hold every part.

* memory: ``/dev/shm/trainpod/<job>/<node>`` (tmpfs: survives the worker, not the node)
* scratch: the node's local NVMe, ``$TRAINPOD_JOB_SCRATCH_DIR/ckpt``
* peer: a copy of this node's part on the next node of ``TRAINPOD_NODES`` (:class:`PeerTier`,
  here through the shared file system of the local backend; a network transport can take
  its place by implementing the same methods)
* durable: any fsspec URL (``file://``, ``s3://`` with s3fs installed, ``memory://``)

Methods block and raise ``OSError`` (or what the fsspec backend raises); instances are used
from one thread at a time.
"""

from __future__ import annotations

import functools
import io
import os
import re
import shutil
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from fsspec import AbstractFileSystem  # type: ignore[import-untyped]  # no type hints
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]

from trainpod.ckpt.filecopy import copy_file
from trainpod.ckpt.manifest import CHUNK, MANIFEST, Manifest, write_atomic
from trainpod.ckpt.reuse import REUSE, claimed, drop, keep_for_reuse, open_locked
from trainpod.ckpt.writefs import PREPARED

_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_name(step: int) -> str:
    return f"step-{step:010d}"


@dataclass(frozen=True)
class Location:
    """A committed copy of a checkpoint that this rank can read."""

    tier: str
    step: int
    path: str
    """The directory, in the tier's file system."""
    origin: str | None
    """For node-scoped tiers, the node whose part this directory holds; None for global."""


class Meter:
    """Bytes copied so far and an optional bandwidth cap. Thread-safe; ``add`` may sleep.

    ``on_progress(meter)`` is called from the copying thread at most every ``every_s``.
    """

    def __init__(
        self,
        bandwidth_bps: float | None = None,
        on_progress: Callable[[Meter], None] | None = None,
        every_s: float = 1.0,
    ) -> None:
        self.bandwidth_bps = bandwidth_bps
        self.on_progress = on_progress
        self.every_s = every_s
        self._next_report = 0.0
        self._lock = threading.Lock()
        self.step: int | None = None
        self.tier: str | None = None
        self.done = 0
        self.total = 0
        self._t0 = time.monotonic()
        self._throttled = 0

    def start(self, step: int, tier: str, total: int) -> None:
        with self._lock:
            self.step, self.tier, self.done, self.total = step, tier, 0, total
            self._t0 = time.monotonic()
            self._throttled = 0

    def add(self, n: int, throttled: bool) -> None:
        with self._lock:
            self.done += n
            if throttled:
                self._throttled += n
            ahead = 0.0
            now = time.monotonic()
            if throttled and self.bandwidth_bps:
                ahead = self._throttled / self.bandwidth_bps - (now - self._t0)
            due = self.on_progress is not None and now >= self._next_report
            if due:
                self._next_report = now + self.every_s
        if due and self.on_progress is not None:
            self.on_progress(self)
        if ahead > 0:
            time.sleep(ahead)

    def rate_bps(self) -> float:
        with self._lock:
            dt = time.monotonic() - self._t0
            return self.done / dt if dt > 0 else 0.0


class Tier(ABC):
    """One place that can hold checkpoints. Subclass to add a transport."""

    name: str
    node_scoped: bool
    """True when a directory holds one node's part (memory, scratch, peer)."""
    throttled: bool
    """Copies into it count against the bandwidth cap (peer, durable)."""
    retry: bool
    """A failed copy is retried with backoff (durable) rather than skipped until the next step."""
    keep: int
    """How many committed checkpoints to keep (retention K)."""

    @abstractmethod
    def put(self, step: int, src: Path, names: Sequence[str], meter: Meter) -> None:
        """Copy ``src/<name>`` for each name into this tier's directory for ``step``."""

    @abstractmethod
    def commit(self, step: int, manifest: Manifest) -> None:
        """Write the manifest atomically (the commit point), then move ``latest``."""

    @abstractmethod
    def discard(self, step: int) -> None:
        """Remove this writer's directory for ``step`` (a failed or torn copy)."""

    @abstractmethod
    def prune(
        self,
        keep: int,
        protect: Iterable[int] = (),
        salvage: Callable[[Path], object] | None = None,
    ) -> None:
        """Keep the newest ``keep`` committed steps; drop older ones and older torn dirs
        (``salvage(step_dir)`` first, on each committed one of a local tier)."""

    def reuser(self) -> Callable[[Path], object] | None:
        """The ``salvage`` with which the copies into this tier prune it: their pruned
        files are written over by the next step's (None: this tier does not)."""
        return None

    def drop_reuse(self) -> None:  # noqa: B027  # a tier that keeps nothing has nothing to do
        """Remove what :meth:`reuser` kept (the job ended, or a copy failed)."""

    @abstractmethod
    def locate(self) -> tuple[list[Location], list[str]]:
        """Committed copies readable from here, and notes on directories that are not."""

    @abstractmethod
    def read_manifest(self, loc: Location) -> bytes: ...

    @abstractmethod
    def open(self, loc: Location, name: str) -> IO[bytes]: ...


_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "abfs", "az"}


class FsTier(Tier):
    """A tier that is a directory tree on an fsspec file system (local or remote)."""

    def __init__(
        self,
        name: str,
        root: str | Path,
        *,
        fs: AbstractFileSystem | None = None,
        node: str | None = None,
        keep: int = 2,
        sync: bool = True,
        throttled: bool = False,
        retry: bool = False,
        prealloc: bool = False,
        reuse: bool = False,
    ) -> None:
        """``node`` set makes the tier node-scoped (it holds that node's part).

        ``sync`` fsyncs copied files and the manifest (off for tmpfs). ``prealloc``: the
        writer allocates each rank's files for the next step after a commit
        (:mod:`trainpod.ckpt.writefs`; local tiers only). ``reuse``: the copies into it
        write over the files of the step they pruned (:mod:`trainpod.ckpt.reuse`; plain
        local files only).
        """
        self.name = name
        self.fs: AbstractFileSystem = fs if fs is not None else LocalFileSystem()
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        # Plain local files: DCP's FileSystemReader and os-level atomic renames apply.
        self.local = isinstance(self.fs, LocalFileSystem) and "file" in protocols
        # Object stores have no directories: s3fs's makedirs would even create a missing
        # *bucket* (a typo'd bucket silently appears, or fails with a misleading error).
        self.has_dirs = not (_OBJECT_STORES & set(protocols))
        self.root = os.fspath(root).rstrip("/") if self.local else str(root).rstrip("/")
        self.node = node
        self.node_scoped = node is not None
        self.keep = keep
        self.sync = sync
        self.throttled = throttled
        self.retry = retry
        self.prealloc = prealloc and self.local
        self.reuse = reuse and type(self.fs) is LocalFileSystem

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.root!r})"

    def step_dir(self, step: int) -> str:
        return f"{self.write_root()}/{step_name(step)}"

    def write_root(self) -> str:
        return self.root

    def prepared_dir(self) -> Path | None:
        """Where the files allocated for the next step wait (None: this tier has none)."""
        return Path(self.write_root()) / PREPARED if self.prealloc else None

    def reuse_dir(self) -> Path | None:
        """Where the files of its pruned steps wait to be written over (None: not kept)."""
        return Path(self.write_root()) / REUSE if self.reuse else None

    def reuser(self) -> Callable[[Path], object] | None:
        d = self.reuse_dir()
        return None if d is None else functools.partial(keep_for_reuse, reuse_dir=d)

    def drop_reuse(self) -> None:
        d = self.reuse_dir()
        if d is not None:
            drop(d)

    # writing ----------------------------------------------------------------------------
    def put(self, step: int, src: Path, names: Sequence[str], meter: Meter) -> None:
        d = self.step_dir(step)
        if self.has_dirs:
            self.fs.makedirs(d, exist_ok=True)
        for name in names:
            self._copy(src / name, f"{d}/{name}", meter)

    def _copy(self, src: Path, dst: str, meter: Meter) -> None:
        size = src.stat().st_size
        if type(self.fs) is LocalFileSystem:  # plain files: the kernel copies, no GIL held
            d = self.reuse_dir()
            with claimed(d, Path(dst)) if d is not None else nullcontext(False) as over:
                copy_file(
                    src,
                    Path(dst),
                    size,
                    lambda n: meter.add(n, self.throttled),
                    sync=self.sync,
                    over=over,
                )
            return
        with src.open("rb") as fin, self.fs.open(dst, "wb") as fout:
            while chunk := fin.read(CHUNK):
                fout.write(chunk)
                meter.add(len(chunk), self.throttled)
            if self.sync and self.local:
                fout.flush()
                try:
                    os.fsync(fout.fileno())
                except (AttributeError, io.UnsupportedOperation):
                    pass
        if not self.local and self.fs.size(dst) != size:
            raise OSError(f"{dst}: wrote {self.fs.size(dst)} bytes of {size}")

    def commit(self, step: int, manifest: Manifest) -> None:
        self.write_whole(f"{self.step_dir(step)}/{MANIFEST}", manifest.to_json())
        self.write_whole(f"{self.write_root()}/latest", f"{step}\n".encode())

    def write_whole(self, path: str, data: bytes) -> None:
        """Write a small file so that readers see all of it or nothing (creating its dir).

        Local: tmp + fsync + rename. Otherwise put + rename: atomic on file systems; on
        object stores the put alone is.
        """
        if self.local:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(Path(path), data, sync=self.sync)
        else:
            if self.has_dirs:
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)

    def discard(self, step: int) -> None:
        d = self.step_dir(step)
        if self.local:
            shutil.rmtree(d, ignore_errors=True)
        elif self.fs.exists(d):
            self.fs.rm(d, recursive=True)

    def prune(
        self,
        keep: int,
        protect: Iterable[int] = (),
        salvage: Callable[[Path], object] | None = None,
    ) -> None:
        """Discard the committed steps beyond the newest ``keep`` (and torn dirs older than
        the newest commit), except ``protect``. ``salvage(step_dir)`` runs on each committed
        step dir of a local tier before it is discarded: it may move files out of it to be
        used again (:func:`~trainpod.ckpt.inplace.salvage`, ADR 0055)."""
        keep_set = set(protect)
        steps = self._steps(self.write_root())
        committed = sorted((s for s, ok in steps.items() if ok), reverse=True)
        keep_set.update(committed[: max(keep, 1)])
        newest = committed[0] if committed else None
        for s, ok in steps.items():
            # Drop old committed copies, and torn dirs older than the newest commit (a torn
            # dir newer than it may be a save in flight).
            if s not in keep_set and (ok or (newest is not None and s < newest)):
                if ok and salvage is not None and self.local:
                    salvage(Path(self.step_dir(s)))
                self.discard(s)

    # reading ----------------------------------------------------------------------------
    def _steps(self, root: str) -> dict[int, bool]:
        """step -> has a manifest, for the step dirs under ``root``."""
        if not self.local:
            self.fs.invalidate_cache(root)  # s3fs caches listings forever, per process
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(root, detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out = {}
        for n in names:
            m = _STEP_DIR.match(n)
            if m:
                out[int(m.group(1))] = self.fs.exists(f"{root}/{n}/{MANIFEST}")
        return out

    def _locate_in(self, root: str, origin: str | None) -> tuple[list[Location], list[str]]:
        locs, notes = [], []
        for s, ok in sorted(self._steps(root).items()):
            path = f"{root}/{step_name(s)}"
            if ok:
                locs.append(Location(self.name, s, path, origin))
            else:
                notes.append(f"step {s} in {self.name} ({path}): no manifest (torn or in flight)")
        return locs, notes

    def locate(self) -> tuple[list[Location], list[str]]:
        return self._locate_in(self.root, self.node)

    def read_manifest(self, loc: Location) -> bytes:
        return bytes(self.fs.cat_file(f"{loc.path}/{MANIFEST}"))

    def open(self, loc: Location, name: str) -> IO[bytes]:
        if type(self.fs) is LocalFileSystem:  # held against being written over (ADR 0056)
            return open_locked(Path(f"{loc.path}/{name}"))
        f: IO[bytes] = self.fs.open(f"{loc.path}/{name}", "rb")
        return f


class PeerTier(FsTier):
    """This node's part copied to the next node's scratch dir: ``<peer>/ckpt-peer/<node>/``.

    ``roots`` maps each node of the job to the directory where it holds peer copies. Reading
    scans every node's directory, so a rank on a replacement node finds the copy of the part
    its rank had on the lost node (the manifest says which node wrote which rank's files).
    """

    def __init__(
        self,
        node: str,
        peer: str,
        roots: Mapping[str, Path],
        *,
        keep: int = 1,
        reuse: bool = False,
    ) -> None:
        super().__init__(
            "peer", roots[peer], node=node, keep=keep, sync=True, throttled=True, reuse=reuse
        )
        self.peer = peer
        self.roots = dict(roots)

    def write_root(self) -> str:
        return f"{self.root}/{self.node}"

    def locate(self) -> tuple[list[Location], list[str]]:
        locs: list[Location] = []
        notes: list[str] = []
        for holder_root in self.roots.values():
            try:
                origins = sorted(p.name for p in Path(holder_root).iterdir() if p.is_dir())
            except OSError:
                continue
            for origin in origins:
                got, why = self._locate_in(f"{holder_root}/{origin}", origin)
                locs += got
                notes += why
        return locs, notes
