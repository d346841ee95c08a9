"""The state database's backup, check and restore (ADR 0034).

:func:`backup` copies a live database with SQLite's online backup API: the copy is one
consistent snapshot even while the controller writes (a WAL reader's view), and it is
written to a temporary file and renamed, so a half-written backup never has the final name.
:func:`check` is what the controller runs before it opens its database, and what
:func:`restore` runs on a backup before it puts it in place: ``PRAGMA integrity_check`` and
a schema version this trainpod understands. :func:`restore` replaces the database atomically
(a rename in the same directory) and removes the old write-ahead log, whose frames belong
to the old file.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from trainpod.errors import Fatal
from trainpod.store.migrations import MIGRATIONS

SIDECARS = ("-wal", "-shm", "-journal")


@dataclass(frozen=True)
class CheckResult:
    """What :func:`check` found: ``ok``, or the check that failed and what it said."""

    path: Path
    failed_check: str = ""
    detail: str = ""
    schema_version: int = 0

    @property
    def ok(self) -> bool:
        return not self.failed_check


class CorruptDatabase(Fatal):
    """The state database (or a backup) fails its checks."""


def check(path: Path, *, quick: bool = False) -> CheckResult:
    """Open ``path`` and run ``PRAGMA integrity_check`` (``quick_check`` when
    ``quick``) and the schema version check. Reads only (SQLite may replay a
    write-ahead log left by a killed writer, as any open would); never raises for a bad file."""
    if not path.is_file():
        return CheckResult(path, "exists", f"{path} is not a file")
    pragma = "quick_check" if quick else "integrity_check"
    try:
        conn = sqlite3.connect(str(path), timeout=30)
    except sqlite3.Error as exc:
        return CheckResult(path, "open", str(exc))
    try:
        rows = [str(r[0]) for r in conn.execute(f"PRAGMA {pragma}").fetchall()]
        if rows != ["ok"]:
            return CheckResult(path, f"PRAGMA {pragma}", "; ".join(rows[:5]))
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    except sqlite3.DatabaseError as exc:  # "file is not a database", a malformed header
        return CheckResult(path, f"PRAGMA {pragma}", str(exc))
    finally:
        conn.close()
    if version < 1 or version > len(MIGRATIONS):
        detail = f"schema version {version}; this trainpod knows 1 to {len(MIGRATIONS)}"
        return CheckResult(path, "schema version", detail, version)
    return CheckResult(path, schema_version=version)


def refuse_corrupt(db: Path, result: CheckResult, restore_hint: str) -> CorruptDatabase:
    """The error a controller stops with when its database failed :func:`check`."""
    return CorruptDatabase(
        f"the state database {db} failed its check ({result.failed_check}: {result.detail}); "
        f"the controller will not start on it. Restore a backup: {restore_hint}"
    )


def backup(db: Path, dest: Path) -> Path:
    """Copy the live database ``db`` to ``dest`` (created, or replaced) with SQLite's
    online backup API; the copy is checked before it gets its name."""
    if not db.is_file():
        raise Fatal(f"no state database at {db}: is this the right cluster?")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.partial")
    partial.unlink(missing_ok=True)
    src = sqlite3.connect(str(db), timeout=30)
    out = sqlite3.connect(str(partial))
    try:
        src.backup(out)
    finally:
        out.close()
        src.close()
    result = check(partial)
    if not result.ok:
        partial.unlink(missing_ok=True)
        raise CorruptDatabase(
            f"the backup of {db} fails its check ({result.failed_check}: {result.detail}); "
            "the database itself may be damaged: `trainpod cluster restore` an older backup"
        )
    _fsync(partial)
    os.replace(partial, dest)
    _fsync_dir(dest.parent)
    return dest


def restore(source: Path, db: Path) -> CheckResult:
    """Put the backup ``source`` in place of ``db`` after checking it; the caller has made
    sure no controller has the database open."""
    result = check(source)
    if not result.ok:
        raise CorruptDatabase(
            f"the backup {source} fails its check ({result.failed_check}: {result.detail}); "
            f"choose another backup (the default ones are in {source.parent})"
        )
    staged = db.with_name(f".{db.name}.restoring")
    staged.unlink(missing_ok=True)
    src = sqlite3.connect(str(source))
    out = sqlite3.connect(str(staged))
    try:
        src.backup(out)
    finally:
        out.close()
        src.close()
    _fsync(staged)
    for suffix in SIDECARS:  # the old log's frames would be replayed onto the new file
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    os.replace(staged, db)
    _fsync_dir(db.parent)
    return result


def default_backup_path(backups_dir: Path, now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return backups_dir / f"controller-{stamp}.db"


def newest_backup(backups_dir: Path) -> Path | None:
    found = sorted(backups_dir.glob("controller-*.db"))
    return found[-1] if found else None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
