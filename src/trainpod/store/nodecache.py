"""The nodes table, kept in memory by the :class:`~trainpod.store.repo.Store` that writes it.

Every heartbeat reads its node's row (twice: the intake and the orders), and every
scheduling pass reads all of them (a thousand rows, each with ~2 KB of facts, built into
:class:`NodeRow` objects: ~25 ms a pass on this box, a pass after every change). The rows
change only through the store's own writes, so the store keeps them: loaded whole on first
read, a written row read back once after its write (decoded exactly as any read decodes it;
the columns of a heartbeat are set on the kept row as SQLite reads them back),
the whole table dropped on an insert, a bulk write or a rollback (reloaded when next read).

The store is serialised by the controller's lock; a reader that is not (a view) can at worst
load the table while a write is under way. A load is kept only if no write happened during
it (``_generation``), so the cache never keeps a row older than the table.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from trainpod.store.rows import NodeRow


class NodeCache:
    def __init__(self, load: Callable[[], list[NodeRow]]) -> None:
        self._load = load
        self._rows: dict[str, NodeRow] | None = None
        self._generation = 0  # moves on every write, under _lock
        self._lock = threading.Lock()

    def rows(self) -> dict[str, NodeRow]:
        """Every node by name, in the table's order: the cache's own dict, to be read at
        once (``list(...values())``, a lookup), never kept or changed."""
        rows = self._rows
        if rows is not None:
            return rows
        with self._lock:
            began = self._generation
        loaded = {r.name: r for r in self._load()}
        with self._lock:
            if self._generation == began:
                self._rows = loaded
        return loaded

    def kept(self, name: str) -> NodeRow | None:
        """``name``'s row if the table is loaded (None: not loaded, or no such node)."""
        rows = self._rows
        return None if rows is None else rows.get(name)

    def written(self, row: NodeRow | None, name: str) -> None:
        """``name`` was written and now reads as ``row`` (None: it is gone)."""
        with self._lock:
            self._generation += 1
            rows = self._rows
            if rows is None:
                return
            if row is None:
                self._rows = None
            elif name in rows:
                rows[name] = row  # in place: the dict's size stays, so no reader's copy fails
            else:
                self._rows = None

    def drop(self) -> None:
        """Forget every row (an insert, a write of many rows, a rollback)."""
        with self._lock:
            self._generation += 1
            self._rows = None
