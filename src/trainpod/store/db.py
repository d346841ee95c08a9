"""Opening the controller's SQLite database: WAL mode, foreign keys, migrations."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from trainpod.errors import Fatal
from trainpod.store.migrations import MIGRATIONS


def schema_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def migrate(conn: sqlite3.Connection) -> int:
    """Apply every migration newer than the database's version; return the new version.

    Idempotent. Raises :class:`Fatal` when the database was written by a newer trainpod.
    """
    current = schema_version(conn)
    if current > len(MIGRATIONS):
        raise Fatal(
            f"the state database is at schema version {current}, newer than this trainpod "
            f"understands ({len(MIGRATIONS)}); upgrade trainpod to open it"
        )
    for version in range(current, len(MIGRATIONS)):
        with conn:
            conn.executescript(
                "BEGIN;" + MIGRATIONS[version] + f"PRAGMA user_version = {version + 1};COMMIT;"
            )
    return schema_version(conn)


def open_db(path: Path | str, *, busy_timeout_s: float = 30.0) -> sqlite3.Connection:
    """Open (creating if needed) and migrate the database at ``path``.

    The connection may be used from several threads; callers serialise access. A write
    waits up to ``busy_timeout_s`` for a lock another process holds.
    """
    conn = sqlite3.connect(
        str(path), check_same_thread=False, isolation_level=None, timeout=busy_timeout_s
    )
    conn.row_factory = sqlite3.Row
    if str(path) != ":memory:":
        conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA foreign_keys=ON")
    migrate(conn)
    return conn
