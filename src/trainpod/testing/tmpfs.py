"""A small tmpfs of a given size, for tests of full and read-only disks (real ENOSPC, real
EROFS: no mock of ``os.write``). Mounting needs root (or CAP_SYS_ADMIN); where it is not
allowed, :func:`tmpfs` raises :class:`TmpfsUnavailable` with the reason, for a test to skip."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class TmpfsUnavailable(RuntimeError):
    """Mounting a tmpfs is not permitted here (not root, or in a container without it)."""


def _mount(*args: str) -> str | None:
    try:
        done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``mount -o size=``: ``1m``, ``64k``) on ``path`` (created),
    unmount it after. Raises :class:`TmpfsUnavailable` when mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    why = _mount("-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(path))
    if why is not None:
        raise TmpfsUnavailable(f"cannot mount a {size} tmpfs on {path}: {why}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False, timeout=30)


def remount_read_only(path: Path) -> None:
    """Make the tmpfs on ``path`` read-only (writes then fail with EROFS, even for root)."""
    why = _mount("-o", "remount,ro", str(path))
    if why is not None:
        raise TmpfsUnavailable(f"cannot remount {path} read-only: {why}")
