"""store/backup.py and store/faults.py on real SQLite files (ADR 0034)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from trainpod.errors import StoreUnavailable
from trainpod.model.events import ControllerStarted
from trainpod.store.backup import CorruptDatabase, backup, check, newest_backup, restore
from trainpod.store.migrations import MIGRATIONS
from trainpod.store.repo import Store


def _store_with_jobs(path: Path, n: int) -> Store:
    store = Store.open(path)
    with store.transaction():
        for i in range(n):
            store.insert_job(f"j{i}", {"command": ["true"]}, float(i))
            store.append(float(i), ControllerStarted(restarted=False))
    return store


def test_backup_of_a_live_database_then_restore(tmp_path: Path) -> None:
    db = tmp_path / "controller.db"
    store = _store_with_jobs(db, 3)
    copy = backup(db, tmp_path / "backups" / "controller-1.db")  # the store is still open
    assert newest_backup(tmp_path / "backups") == copy
    with store.transaction():  # written after the backup: not in it
        store.insert_job("late", {"command": ["true"]}, 9.0)
    store.close()
    result = restore(copy, db)
    assert result.ok and result.schema_version == len(MIGRATIONS)
    assert not Path(f"{db}-wal").exists()
    again = Store.open(db)
    assert [j.name for j in again.jobs()] == ["j0", "j1", "j2"]
    assert len(again.events()) == 3


def test_check_names_what_failed(tmp_path: Path) -> None:
    db = tmp_path / "controller.db"
    _store_with_jobs(db, 1).close()
    assert check(db).ok
    with db.open("r+b") as f:
        f.write(b"\xff" * 100)
    result = check(db, quick=True)
    assert result.failed_check == "PRAGMA quick_check"
    assert "not a database" in result.detail
    with pytest.raises(CorruptDatabase, match="choose another backup"):
        restore(db, tmp_path / "other.db")


def test_check_refuses_a_newer_schema(tmp_path: Path) -> None:
    db = tmp_path / "new.db"
    with sqlite3.connect(db) as conn:
        conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    result = check(db)
    assert result.failed_check == "schema version"
    assert f"this trainpod knows 1 to {len(MIGRATIONS)}" in result.detail


def test_a_lock_held_elsewhere_is_store_unavailable(tmp_path: Path) -> None:
    db = tmp_path / "controller.db"
    _store_with_jobs(db, 1).close()
    store = Store.open(db, busy_timeout_s=0.05)
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        locked = pytest.raises(StoreUnavailable, match="locked by another process")
        with locked, store.transaction():
            store.insert_job("refused", {"command": ["true"]}, 1.0)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert [j.name for j in store.jobs()] == ["j0"]
    with store.transaction():
        store.insert_job("after", {"command": ["true"]}, 2.0)
    assert [j.name for j in store.jobs()] == ["j0", "after"]


def test_a_full_database_is_store_unavailable_and_nothing_half_written(tmp_path: Path) -> None:
    """``max_page_count`` makes SQLite answer SQLITE_FULL as a full disk does."""
    db = tmp_path / "controller.db"
    store = _store_with_jobs(db, 1)
    pages = int(store.connection.execute("PRAGMA page_count").fetchone()[0])
    store.connection.execute(f"PRAGMA max_page_count = {pages}")
    big = {"command": ["true"], "blob": "x" * 100_000}
    full = pytest.raises(StoreUnavailable, match=r"disk full: .* free space and retry")
    with full, store.transaction():
        with pytest.raises(StoreUnavailable), store.savepoint():
            store.insert_job("too-big", big, 1.0)
        with store.savepoint():  # a later block of the same batch
            store.insert_job("small", {"command": ["true"]}, 2.0)
    assert [j.name for j in store.jobs()] == ["j0"]
    store.connection.execute(f"PRAGMA max_page_count = {pages * 100}")
    with store.transaction():
        store.insert_job("after", big, 3.0)
    assert [j.name for j in store.jobs()] == ["j0", "after"]
    assert check(db).ok
