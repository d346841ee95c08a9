"""The disk check: free space, a real write test, and per-directory quotas.

For each named path: free space on its file system (``shutil.disk_usage``), a write test
(write, fsync, read back, delete a small file) and, where a quota is set, the bytes used
under the directory against that quota. Quotas let the chaos tool make a disk "full" with
a small real file (:func:`fill`) instead of filling the whole file system.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, ClassVar

from trainpod.agent.health.base import CheckResult, HealthCheck, Status

GIB = 2**30
MIB = 2**20
BALLAST = ".trainpod-ballast"
_PROBE_BYTES = 4096
_WALK_LIMIT = 100_000  # files; past this the quota walk stops and says so


class DiskCheck(HealthCheck):
    """Checks every path in ``paths`` (name -> directory). Blocking; a few ms per path.

    FAULT when a path is missing, not writable (ENOSPC, EROFS, EIO, ...), has less than
    ``min_free_gib`` free, or uses more than its ``quota_gib[name]``.
    """

    name: ClassVar[str] = "disk"

    def __init__(
        self,
        paths: dict[str, Path],
        min_free_gib: float = 1.0,
        quota_gib: dict[str, float] | None = None,
    ) -> None:
        unknown = set(quota_gib or {}) - set(paths)
        if unknown:
            raise ValueError(f"quota for unknown paths {sorted(unknown)}; known: {sorted(paths)}")
        self.paths = dict(paths)
        self.min_free_gib = min_free_gib
        self.quota_gib = dict(quota_gib or {})

    def run(self) -> CheckResult:
        faults: list[str] = []
        facts: dict[str, Any] = {}
        for name, path in self.paths.items():
            info: dict[str, Any] = {"path": str(path)}
            facts[name] = info
            try:
                usage = shutil.disk_usage(path)
            except OSError as exc:
                faults.append(f"{name}: {path} unusable ({_describe(exc)})")
                info["error"] = _describe(exc)
                continue
            info["free_gib"] = round(usage.free / GIB, 3)
            info["total_gib"] = round(usage.total / GIB, 3)
            if usage.free < self.min_free_gib * GIB:
                faults.append(
                    f"disk full: {path} has {usage.free / GIB:.3g} GiB free "
                    f"(less than {self.min_free_gib:g} GiB)"
                )
            error = write_test(path)
            info["write_ok"] = error is None
            if error is not None:
                info["write_error"] = error
                faults.append(f"{name}: write test failed in {path} ({error})")
            quota = self.quota_gib.get(name)
            if quota is not None:
                used, complete = used_bytes(path)
                info.update(used_gib=round(used / GIB, 4), quota_gib=quota, walk_complete=complete)
                if used > quota * GIB:
                    faults.append(
                        f"disk full: {path} uses {used / GIB:.3g} GiB of its {quota:g} GiB quota"
                    )
        if faults:
            return CheckResult(self.name, Status.FAULT, "; ".join(faults), facts)
        return CheckResult(self.name, Status.OK, f"{len(self.paths)} paths writable", facts)


def write_test(path: Path) -> str | None:
    """Write, fsync, read back and delete a small file in ``path``; None if all went well.

    Returns a description of the failure (errno name and message, or a content mismatch).
    """
    # Unique per call: two checks of one agent (the scheduled run and one a finished deep
    # check asks for) may run at once, and a shared name made one read the other's bytes.
    probe = path / f".trainpod-health-{os.getpid()}-{secrets.token_hex(6)}"
    data = os.urandom(_PROBE_BYTES)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        back = probe.read_bytes()
    except OSError as exc:
        return _describe(exc)
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None if back == data else "read back differs from what was written"


def used_bytes(path: Path) -> tuple[int, bool]:
    """Bytes in regular files under ``path`` (apparent size, symlinks not followed).

    Returns (bytes, complete); ``complete`` is False when the walk stopped at its limit.
    """
    total = 0
    files = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            files += 1
            if files > _WALK_LIMIT:
                return total, False
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue  # deleted while walking
            total += st.st_size
    return total, True


def fill(path: Path, quota_gib: float) -> Path:
    """Write a real ballast file in ``path`` so that it exceeds ``quota_gib`` by ~1 MiB.

    The file is ``<path>/.trainpod-ballast``, allocated with ``os.posix_fallocate`` (or
    written with zeros where that is unsupported). Idempotent: an existing ballast is
    resized. Returns the ballast path. Undo with :func:`unfill`.
    """
    ballast = path / BALLAST
    unfill(path)
    used, _ = used_bytes(path)
    size = max(int(quota_gib * GIB) - used, 0) + MIB
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            _write_zeros(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    return ballast


def unfill(path: Path) -> None:
    """Remove the ballast written by :func:`fill`, if any. Idempotent."""
    try:
        (path / BALLAST).unlink()
    except FileNotFoundError:
        pass


def _write_zeros(fd: int, size: int) -> None:
    chunk = bytes(MIB)
    left = size
    while left > 0:
        left -= os.write(fd, chunk[: min(left, MIB)])


def _describe(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0, "error")
    return f"{code}: {exc.strerror or exc}"
