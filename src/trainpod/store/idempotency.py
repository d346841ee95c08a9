"""The ``Idempotency-Key`` of each creating call, per caller (migration 10, ADR 0037).

A row says what the caller's first call with that key made (``made``: a job's id), the
request as it was received with secret values masked (``request``, so that a reuse with
another body can be told what changed) and a salted SHA-256 of the whole request, secret
values included (``fingerprint``: ``salt:digest``). Rows older than the keys' lifetime are
ignored, and removed by the next call that remembers a key.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from trainpod.store.repo import Store


@dataclass(frozen=True)
class KeyRow:
    owner: str
    key: str
    operation: str
    made: int
    request: str
    fingerprint: str
    created_at: float


class IdempotencyKeys:
    """Typed access to ``idempotency_keys`` (inside the store's transactions)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    @property
    def _conn(self) -> sqlite3.Connection:
        return self._store.connection

    def find(self, owner: str, key: str, since: float) -> KeyRow | None:
        """``owner``'s row for ``key`` if it was made at ``since`` or later, else None."""
        row = self._conn.execute(
            "SELECT owner, key, operation, made, request, fingerprint, created_at "
            "FROM idempotency_keys WHERE owner = ? AND key = ? AND created_at >= ?",
            (owner, key, since),
        ).fetchone()
        return None if row is None else KeyRow(*row)

    def put(self, row: KeyRow) -> None:
        """Remember ``row`` (an expired row of the same owner and key is replaced)."""
        self._conn.execute(
            "INSERT OR REPLACE INTO idempotency_keys"
            "(owner, key, operation, made, request, fingerprint, created_at) "
            "VALUES(?, ?, ?, ?, ?, ?, ?)",
            (
                row.owner,
                row.key,
                row.operation,
                row.made,
                row.request,
                row.fingerprint,
                row.created_at,
            ),
        )

    def prune(self, before: float) -> int:
        """Forget the keys made before ``before``; how many went."""
        cur = self._conn.execute("DELETE FROM idempotency_keys WHERE created_at < ?", (before,))
        return cur.rowcount

    def count(self) -> int:
        return int(self._conn.execute("SELECT count(*) FROM idempotency_keys").fetchone()[0])
