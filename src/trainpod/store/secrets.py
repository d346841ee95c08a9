"""A job's secret env values (``trainpod submit --secret-env``), kept apart from its spec.

The job's spec (``jobs.spec``) holds the secret variables' names only, each with the value
:data:`MASKED`; the values live in ``job_secrets`` (migration 9), read by one caller: the
controller's order desk, when it builds a launch order for the job's ranks. No view, event,
log or metric reads this table. The values are removed when the job ends.
"""

from __future__ import annotations

import json
import sqlite3

from trainpod.store.repo import Store

MASKED = "***"
"""What a secret env value is shown as, wherever its job's spec is shown."""


class JobSecrets:
    """Typed access to ``job_secrets`` (inside the store's transactions)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    @property
    def _conn(self) -> sqlite3.Connection:
        return self._store.connection

    def put(self, job_id: int, env: dict[str, str]) -> None:
        if env:
            self._conn.execute(
                "INSERT OR REPLACE INTO job_secrets(job_id, env) VALUES(?, ?)",
                (job_id, json.dumps(env, sort_keys=True)),
            )

    def get(self, job_id: int) -> dict[str, str]:
        row = self._conn.execute(
            "SELECT env FROM job_secrets WHERE job_id = ?", (job_id,)
        ).fetchone()
        return {} if row is None else {str(k): str(v) for k, v in json.loads(row[0]).items()}

    def forget(self, job_id: int) -> None:
        self._conn.execute("DELETE FROM job_secrets WHERE job_id = ?", (job_id,))
