"""The state database's log is folded by the checkpointer's thread, not inside a commit."""

from __future__ import annotations

from pathlib import Path

from trainpod.store.repo import Store
from trainpod.store.walcheckpoint import WalCheckpointer
from trainpod.testing.wait import wait_until


def _fill(store: Store, rows: int, prefix: str = "n") -> None:
    """Commits of a ~3 KB row each (1,500 of them: well over SQLite's default 1,000 pages
    of log before a commit checkpoints)."""
    for i in range(rows):
        with store.transaction():
            store.insert_node(f"{prefix}{i}", "g", "compute", False, 1, 0.0)
            store.update_node(f"{prefix}{i}", 1.0, facts="x" * 3000)


def _log_pages(path: Path) -> int:
    wal = path.with_name(path.name + "-wal")
    return wal.stat().st_size // 4096 if wal.exists() else 0


def test_commits_leave_the_log_to_the_checkpointer_which_folds_it(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = Store.open(db)
    store.checkpoint_at(100_000)
    _fill(store, 1500)
    assert _log_pages(db) > 1000  # no commit checkpointed it (the default would have)
    wal = WalCheckpointer(db)
    busy, pages, folded = wal.run_once()
    assert (busy, folded) == (0, pages) and pages > 1000
    size = _log_pages(db)
    _fill(store, 50, "m")  # the log is written again from its start: it does not grow
    assert _log_pages(db) <= size
    wal.close()
    store.close()
    assert not db.with_name("state.db-wal").exists()  # the store's close was the last
    again = Store.open(db)
    assert len(again.nodes()) == 1550
    again.close()


def test_the_thread_checkpoints_every_interval_until_closed(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = Store.open(db)
    store.checkpoint_at(100_000)
    wal = WalCheckpointer(db, every_s=0.05)
    wal.start()
    _fill(store, 10)
    wait_until(lambda: wal.checkpoints >= 2, timeout_s=30, what="two checkpoints")
    wal.close()
    done = wal.checkpoints
    _fill(store, 5, "later")
    assert wal.checkpoints == done  # stopped
    store.close()
