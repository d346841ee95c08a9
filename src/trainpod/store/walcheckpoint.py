"""SQLite's write-ahead log folded into the database by a thread of its own.

By default SQLite checkpoints inside the commit that takes the log past 1,000 pages: that
commit copies the log into the database file and syncs it, while the controller's lock is
held. At 1,000 agents (a row written per heartbeat) that happened every few seconds and
held the lock 20-85 ms on this box, so every heartbeat in flight waited behind it.

:class:`WalCheckpointer` runs a ``PASSIVE`` checkpoint every ``every_s`` on its own
connection, outside the lock (WAL lets it run beside the writer: it copies what no reader
still needs and never blocks anyone). The store's connection keeps an automatic checkpoint
only as a cap (:data:`AUTOCHECKPOINT_CAP_PAGES`), for a checkpointer that cannot keep up or
has stopped. Closed before the store, so that the store's close is the last one and folds
what is left (a stopped cluster's state is one file, ADR 0034).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

AUTOCHECKPOINT_CAP_PAGES = 10_000  # ~40 MB of log before a commit checkpoints by itself
EVERY_S = 1.0
_QUIET_S = 60.0  # a failing checkpoint is logged at most this often


class WalCheckpointer:
    def __init__(self, path: Path | str, *, every_s: float = EVERY_S) -> None:
        self._path = str(path)
        self._every_s = every_s
        self._conn: sqlite3.Connection | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the connection: the thread's, or close()'s
        self._logged_at = float("-inf")
        self.checkpoints = 0  # passes that ran (whatever they could fold)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="wal-checkpoint", daemon=True)
        self._thread.start()

    def run_once(self) -> tuple[int, int, int]:
        """One passive checkpoint: (1 if it could not finish because of a lock, pages in
        the log, pages folded into the database)."""
        with self._lock:
            if self._conn is None:
                self._conn = sqlite3.connect(
                    self._path, check_same_thread=False, isolation_level=None, timeout=1.0
                )
            busy, pages, folded = self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            self.checkpoints += 1
            return int(busy), int(pages), int(folded)

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                self.run_once()
            except sqlite3.Error as exc:  # a full disk, say: the commits' cap still applies
                now = time.monotonic()
                if now - self._logged_at >= _QUIET_S:
                    self._logged_at = now
                    log.warning("checkpointing the state database's log failed: %s", exc)

    def close(self) -> None:
        """Stop the thread and close its connection (before the store's own close)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._every_s + 10.0)
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
