"""Bulk reads of the event log for scrapes: some kinds since an id, all events of some jobs."""

from __future__ import annotations

from collections.abc import Sequence

from trainpod.model.states import NodeState
from trainpod.store.repo import Store
from trainpod.store.rows import EventRow

_CHUNK = 900  # SQLite's default limit on host parameters is 999


def events_since(
    store: Store, after: int, kinds: Sequence[str], limit: int | None = None
) -> list[EventRow]:
    """Events of ``kinds`` with an id above ``after``, oldest first (the first ``limit``)."""
    marks = ",".join("?" * len(kinds))
    sql = f"SELECT * FROM events WHERE id > ? AND kind IN ({marks}) ORDER BY id"
    args: list[object] = [after, *kinds]
    if limit is not None:
        sql += " LIMIT ?"
        args.append(limit)
    return [EventRow.from_sql(r) for r in store.connection.execute(sql, args)]


def node_states(store: Store) -> list[tuple[str, str, NodeState]]:
    """(name, group, state) of every node, by name, without reading their facts."""
    rows = store.connection.execute("SELECT name, grp, state FROM nodes ORDER BY name")
    return [(str(n), str(g), NodeState(s)) for n, g, s in rows]


def events_of_jobs(
    store: Store, job_ids: Sequence[int], kinds: Sequence[str] | None = None
) -> dict[int, list[EventRow]]:
    """Every event of each job (only ``kinds``, if given), oldest first (a few queries, not
    one per job)."""
    out: dict[int, list[EventRow]] = {j: [] for j in job_ids}
    ids = list(job_ids)
    only = list(kinds or [])
    chunk = _CHUNK - len(only)
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        sql = f"SELECT * FROM events WHERE job_id IN ({','.join('?' * len(part))})"
        if only:
            sql += f" AND kind IN ({','.join('?' * len(only))})"
        for r in store.connection.execute(sql + " ORDER BY id", [*part, *only]):
            row = EventRow.from_sql(r)
            if row.job_id is not None:
                out[row.job_id].append(row)
    return out
