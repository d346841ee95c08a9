"""SQLite's "cannot write now" errors as :class:`StoreUnavailable` (ADR 0034).

A lock another process holds past the busy timeout (``SQLITE_BUSY``/``SQLITE_LOCKED``) and
a full disk (``SQLITE_FULL``, or an I/O error while the file system has no room left) are
conditions of the machine, not bugs: the transaction is rolled back, nothing was applied,
and the caller is told why and what to do, which the API answers with 503.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from trainpod.errors import StoreUnavailable

_BUSY = {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED}
_FULL = sqlite3.SQLITE_FULL
_IOERR = sqlite3.SQLITE_IOERR


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def unavailable(exc: BaseException, db: Path, busy_timeout_s: float) -> StoreUnavailable | None:
    """The error to raise instead of ``exc``, or None when ``exc`` is something else."""
    if not isinstance(exc, sqlite3.OperationalError):
        return None
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    free = _free_bytes(db)
    if code in _BUSY:
        return StoreUnavailable(
            f"the state database {db} is locked by another process (waited "
            f"{busy_timeout_s:g} s, storage.state_db_busy_timeout_s): nothing was applied; "
            "retry once that process (a backup, a sqlite3 shell) lets go"
        )
    if code == _FULL or (code == _IOERR and free is not None and free < 1 << 20):
        return StoreUnavailable(
            f"disk full: the state database {db} cannot be written ({exc}; "
            f"{'?' if free is None else free} bytes free on {db.parent}): nothing was "
            "applied; free space and retry"
        )
    if code == _IOERR:
        return StoreUnavailable(
            f"the state database {db} cannot be written ({exc}): nothing was applied; "
            "check the disk, then retry"
        )
    return None
