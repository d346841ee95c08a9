"""Bulk reads for scrapes: some kinds of event since an id, all events of some jobs, and what
goodput reads of jobs' records (:func:`job_facts`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from trainpod.model.states import AttemptState, JobState, NodeState
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


@dataclass(frozen=True)
class FirstRank:
    started_at: float


@dataclass(frozen=True)
class AttemptFacts:
    """An attempt as goodput reads it; ``ranks``: its earliest rank start, if any started."""

    number: int
    state: AttemptState
    nodes: list[str]
    created_at: float
    started_at: float | None
    ended_at: float | None
    cause: str
    ranks: tuple[FirstRank, ...]


@dataclass(frozen=True)
class JobFacts:
    id: int
    state: JobState
    submitted_at: float
    ended_at: float | None
    attempts: tuple[AttemptFacts, ...]


def job_facts(store: Store, job_ids: Sequence[int]) -> list[JobFacts]:
    """The jobs ``job_ids`` (unknown ones left out), by id, with their attempts (oldest
    first): the record :func:`trainpod.telemetry.goodput.compute_goodput` reads, in two
    queries, without decoding specs, failures or rank rows."""
    if not job_ids:
        return []
    ids = json.dumps(list(job_ids))
    attempts: dict[int, list[AttemptFacts]] = {}
    rows = store.connection.execute(
        "SELECT a.job_id, a.number, a.state, a.nodes, a.created_at, a.started_at, a.ended_at,"
        " a.cause, (SELECT MIN(r.started_at) FROM ranks r WHERE r.attempt_id = a.id)"
        " FROM attempts a JOIN json_each(?) j ON a.job_id = j.value"
        " ORDER BY a.job_id, a.number",
        (ids,),
    )
    for job_id, number, state, nodes, created, started, ended, cause, first in rows:
        attempts.setdefault(job_id, []).append(
            AttemptFacts(
                number=number,
                state=AttemptState(state),
                nodes=json.loads(nodes),
                created_at=created,
                started_at=started,
                ended_at=ended,
                cause=cause,
                ranks=() if first is None else (FirstRank(first),),
            )
        )
    rows = store.connection.execute(
        "SELECT j.id, j.state, j.submitted_at, j.ended_at FROM jobs j JOIN json_each(?) i"
        " ON j.id = i.value ORDER BY j.id",
        (ids,),
    )
    return [
        JobFacts(job_id, JobState(state), submitted, ended, tuple(attempts.get(job_id, [])))
        for job_id, state, submitted, ended in rows
    ]


def job_labels(
    store: Store, job_ids: Sequence[int]
) -> list[tuple[int, float, str | None, str | None, str | None, str | None]]:
    """(id, submitted_at, team, priority_class, partition, user) of the jobs ``job_ids``,
    from their specs' JSON in SQLite (no spec decoded here)."""
    if not job_ids:
        return []
    rows = store.connection.execute(
        "SELECT j.id, j.submitted_at, json_extract(j.spec, '$.team'),"
        " json_extract(j.spec, '$.priority_class'), json_extract(j.spec, '$.partition'),"
        " json_extract(j.spec, '$.user') FROM jobs j JOIN json_each(?) i ON j.id = i.value"
        " ORDER BY j.id",
        (json.dumps(list(job_ids)),),
    )
    return [tuple(r) for r in rows]


def job_counts(store: Store) -> list[tuple[JobState, str | None, str | None, str | None, int]]:
    """(state, team, priority_class, partition, jobs) for every combination in the store:
    one read of the ``jobs_labels`` index (migration 11), no spec decoded."""
    rows = store.connection.execute(
        "SELECT state, json_extract(spec, '$.team'), json_extract(spec, '$.priority_class'),"
        " json_extract(spec, '$.partition'), COUNT(*) FROM jobs GROUP BY 1, 2, 3, 4"
    )
    return [(JobState(r[0]), r[1], r[2], r[3], int(r[4])) for r in rows]


def recently_ended(store: Store, after: float) -> list[int]:
    """The ended jobs that ended after ``after`` (a range of the ``ended_at`` index)."""
    ended = [s.value for s in JobState if s.ended]
    rows = store.connection.execute(  # no ORDER BY: SQLite would scan by id to avoid a sort
        f"SELECT id FROM jobs WHERE ended_at > ? AND +state IN ({','.join('?' * len(ended))})",
        (after, *ended),
    )
    return sorted(int(r[0]) for r in rows)


def jobs_changed(store: Store, after: int | None) -> tuple[int, set[int]]:
    """The newest event id, and the jobs with an event above ``after`` up to it (None: no
    jobs, only the id): what changed since a reader's last look."""
    row = store.connection.execute("SELECT MAX(id) FROM events").fetchone()
    newest = int(row[0]) if row is not None and row[0] is not None else 0
    if after is None or newest <= after:
        return newest, set()
    rows = store.connection.execute(
        "SELECT DISTINCT job_id FROM events WHERE id > ? AND id <= ? AND job_id IS NOT NULL",
        (after, newest),
    )
    return newest, {int(r[0]) for r in rows}
