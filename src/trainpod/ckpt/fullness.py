"""Is a tier's file system full or unwritable? Which tier a save falls back to.

A save that cannot go into the fastest tier (``/dev/shm`` full, a quota, a read-only or
denied mount) goes into the next node-local tier instead (docs/decisions/0036). Whether a
failed write was "the tier is full or unwritable" rather than a bug is decided here, from
what the file system says, not from the exception alone: DCP reports a short write of a
tensor as a ``RuntimeError`` of torch's serializer ("unexpected pos"), wrapped in its
``CheckpointException``, with no errno anywhere. So a failure counts when

* an ``OSError`` in it (its causes, DCP's per-rank failures) has errno ENOSPC, EDQUOT, EROFS
  or EACCES, or
* the file system is mounted read-only, or
* after the failed write less than :data:`LOW_FREE` bytes are free on it.

Before writing, :func:`precheck` refuses a tier with less free space than the node's part
of the step needs (the staged bytes): the save goes on at once instead of filling the RAM
that NCCL's shared-memory transport also lives in, then failing.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainpod.ckpt.tiers import FsTier, PeerTier, Tier
from trainpod.ckpt.writefs import prepared_bytes

UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES}
"""The errnos that send a save to the next tier."""
LOW_FREE = 1 << 20
"""Under this many free bytes after a failed write, the tier was full (1 MiB)."""


@dataclass(frozen=True)
class Full:
    """A tier that could not take a step on one node: why, and the space."""

    tier: str
    path: str
    reason: str
    """``ENOSPC``, ``EDQUOT``, ``EROFS`` or ``EACCES``, then what was seen."""
    needed: int
    """Bytes the node's part of the step needs (the staged bytes of its ranks)."""
    free: int | None
    """Bytes free on the tier's file system once the partial write was removed (None:
    unknown)."""

    def describe(self) -> str:
        free = "unknown" if self.free is None else f"{self.free} bytes"
        return f"{self.tier} ({self.path}): {self.reason}; needed {self.needed} bytes, free {free}"


def existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (a tier's root may not exist yet)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s file system (None: unknown)."""
    try:
        st = os.statvfs(existing(Path(path)))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def same_device(a: Tier, b: Tier) -> bool:
    """Whether two tiers write to one local device (the nearest existing directory of each
    root has one ``st_dev``). A store that is not a local path (s3://, a remote fsspec file
    system) is never the node's disk."""
    if not (isinstance(a, FsTier) and isinstance(b, FsTier) and a.local and b.local):
        return False
    try:
        return existing(Path(a.write_root())).stat().st_dev == (
            existing(Path(b.write_root())).stat().st_dev
        )
    except OSError:
        return False


def read_only(path: str | Path) -> bool:
    try:
        return bool(os.statvfs(existing(Path(path))).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _errors(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and DCP's per-rank failures, once each."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        failures = getattr(e, "failures", None)  # torch's CheckpointException
        if isinstance(failures, dict):
            for f in failures.values():
                first = f[0] if isinstance(f, tuple) and f else f
                if isinstance(first, BaseException):
                    todo.append(first)


def unwritable(tier: FsTier, exc: BaseException | None, needed: int) -> Full | None:
    """Why ``tier`` cannot take a step of ``needed`` bytes: after the write failed with
    ``exc`` (measure before removing the partial files), or before writing (``exc`` None:
    too little free space, or read-only). None: it can, or the failure was something else."""
    root = tier.write_root()
    free = free_bytes(root)
    reason = None
    if exc is not None:
        for e in _errors(exc):
            if isinstance(e, OSError) and e.errno in UNWRITABLE:
                reason = f"{errno.errorcode[e.errno]}: {e.strerror or e}"
                break
    if reason is None and read_only(root):
        reason = "EROFS: the file system is mounted read-only"
    if reason is None and free is not None:
        if exc is not None and free < LOW_FREE:
            reason = f"ENOSPC: the write failed with {free} bytes left ({type(exc).__name__})"
        elif exc is None and free + _prepared(tier) < needed:
            reason = "ENOSPC: not enough free space (checked before writing)"
    if reason is None:
        return None
    return Full(tier.name, root, reason, needed, free)


def _prepared(tier: FsTier) -> int:
    """Bytes the tier holds allocated for the next step's files: free for this write."""
    d = tier.prepared_dir()
    return 0 if d is None else prepared_bytes(d)


def fallbacks(tiers: Sequence[Tier]) -> list[FsTier]:
    """The tiers a step may be written into, fastest first: the primary, then the other
    node-local directories this node owns (scratch; not a peer's, not the durable store)."""
    return [
        t
        for t in tiers
        if isinstance(t, FsTier) and t.local and t.node_scoped and not isinstance(t, PeerTier)
    ]


def nowhere(fulls: Iterable[Full]) -> str:
    """The error when no tier could take a step: every tier tried and its free space."""
    return "no node-local tier can take the step: " + "; ".join(f.describe() for f in fulls)
