"""Users and their bearer tokens, next to the rest of the cluster's state.

A token is 32 random bytes shown once, when it is issued; only its SHA-256 is stored, so a
copy of the database gives nobody a way in. Tokens are looked up by that hash.
"""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
from dataclasses import dataclass

from trainpod.store.repo import Store

TOKEN_PREFIX = "tp_"


@dataclass(frozen=True)
class UserRow:
    name: str
    team: str | None
    role: str  # "user" | "admin"
    account: str | None  # the POSIX account their work runs as (None: the agent's)
    source: str  # "spec" (declared in the cluster spec) | "cli" (added with `users add`)
    created_at: float


@dataclass(frozen=True)
class TokenRow:
    id: str
    user: str
    created_at: float
    revoked_at: float | None


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Accounts:
    """Typed access to the users and tokens tables (inside the store's transactions)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    @property
    def _conn(self) -> sqlite3.Connection:
        return self._store.connection

    def upsert_user(
        self,
        name: str,
        *,
        team: str | None,
        role: str,
        account: str | None,
        source: str,
        now: float,
    ) -> None:
        self._conn.execute(
            "INSERT INTO users(name, team, role, account, source, created_at) "
            "VALUES(?,?,?,?,?,?) ON CONFLICT(name) DO UPDATE SET team = excluded.team, "
            "role = excluded.role, account = excluded.account, source = excluded.source",
            (name, team, role, account, source, now),
        )

    def user(self, name: str) -> UserRow | None:
        row = self._conn.execute(
            "SELECT name, team, role, account, source, created_at FROM users WHERE name = ?",
            (name,),
        ).fetchone()
        return None if row is None else UserRow(*row)

    def users(self) -> list[UserRow]:
        rows = self._conn.execute(
            "SELECT name, team, role, account, source, created_at FROM users ORDER BY name"
        ).fetchall()
        return [UserRow(*r) for r in rows]

    def issue(self, user: str, now: float) -> tuple[TokenRow, str]:
        """A fresh token for ``user``: its row and the token itself (never stored)."""
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        row = TokenRow(id=secrets.token_hex(4), user=user, created_at=now, revoked_at=None)
        self._conn.execute(
            "INSERT INTO tokens(id, user, hash, created_at) VALUES(?,?,?,?)",
            (row.id, user, token_hash(token), now),
        )
        return row, token

    def tokens(self, user: str | None = None) -> list[TokenRow]:
        sql = "SELECT id, user, created_at, revoked_at FROM tokens"
        args: tuple[str, ...] = ()
        if user is not None:
            sql, args = sql + " WHERE user = ?", (user,)
        return [TokenRow(*r) for r in self._conn.execute(sql + " ORDER BY created_at", args)]

    def revoke(self, user: str, now: float, token_id: str | None = None) -> list[str]:
        """Revoke the user's live tokens (or the one ``token_id``); the ids revoked."""
        live = [t.id for t in self.tokens(user) if t.revoked_at is None]
        ids = [t for t in live if token_id is None or t == token_id]
        self._conn.executemany(
            "UPDATE tokens SET revoked_at = ? WHERE id = ?", [(now, i) for i in ids]
        )
        return ids

    def live_hashes(self) -> dict[str, str]:
        """hash -> user name, for every token not revoked."""
        rows = self._conn.execute("SELECT hash, user FROM tokens WHERE revoked_at IS NULL")
        return {str(h): str(u) for h, u in rows}
