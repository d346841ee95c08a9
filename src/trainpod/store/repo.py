"""The controller's repository: every read and write of SQLite goes through :class:`Store`.

Writes happen inside :meth:`Store.transaction`; a state change and the event that records
it are committed together or not at all, so a ``kill -9`` at any instant loses neither.
The store is not thread-safe by itself: the controller serialises access with its lock.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainpod.model.events import Event, FaultDetected, Recorded, recorded
from trainpod.model.states import AttemptState, JobState, NodeState, RankState
from trainpod.store.db import open_db
from trainpod.store.faults import unavailable
from trainpod.store.nodecache import NodeCache
from trainpod.store.rows import AttemptRow, EventRow, JobRow, NodeRow, RankRow

_NODE_COLUMNS = {
    "state",
    "reason",
    "job_id",
    "address",
    "agent_id",
    "agent_pid",
    "last_heartbeat",
    "facts",
    "devices",
    "drained",
    "repairs",
    "repair",
    "allocation",
}
# Node columns a heartbeat writes, read back as these types (NodeRow attribute, type).
_PLAIN_NODE: dict[str, tuple[str, type]] = {
    "address": ("address", str),
    "agent_id": ("agent_id", str),
    "agent_pid": ("agent_pid", int),
    "last_heartbeat": ("last_heartbeat", float),
    "facts": ("facts_json", str),
}
_JOB_COLUMNS = {
    "state",
    "reason",
    "started_at",
    "ended_at",
    "cancel_requested",
    "external",
    "held_by",
}
_ATTEMPT_COLUMNS = {
    "state",
    "started_at",
    "ended_at",
    "cause",
    "failure",
    "in_process",
    "nodes",  # a lost node's place taken by a spare in process (ADR 0035)
}
_RANK_COLUMNS = {"state", "pid", "exit_code", "signal", "started_at", "ended_at", "node"}


def _encode(value: Any) -> Any:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, (NodeState, JobState, AttemptState, RankState)):
        return value.value
    if isinstance(value, bool):
        return int(value)
    return value


def _sets(fields: dict[str, Any], allowed: set[str]) -> tuple[str, list[Any]]:
    unknown = set(fields) - allowed
    if unknown:
        raise ValueError(f"cannot update columns {sorted(unknown)}")
    return ", ".join(f"{k} = ?" for k in fields), [_encode(v) for v in fields.values()]


class Store:
    """Typed access to nodes, jobs, attempts, ranks and events."""

    def __init__(self, conn: sqlite3.Connection, *, busy_timeout_s: float = 30.0) -> None:
        self._conn = conn
        self._busy_timeout_s = busy_timeout_s
        self._lost: BaseException | None = None
        self._path = Path(conn.execute("PRAGMA database_list").fetchone()[2] or ":memory:")
        self._depth = 0
        self.appended = 0
        """Events appended through this store so far: a caller compares it before and after
        a change to know whether anything happened (every state change writes an event)."""
        self.work_version = 0
        """Moves on every write to jobs, attempts or ranks, and on every rollback: what is
        read from those tables and kept stays valid while it stays the same."""
        self._nodes = NodeCache(self._read_nodes)

    @property
    def connection(self) -> sqlite3.Connection:
        """For the store's companion repositories (:mod:`trainpod.store.accounts`)."""
        return self._conn

    @classmethod
    def open(cls, path: Path | str, *, busy_timeout_s: float = 30.0) -> Store:
        return cls(open_db(path, busy_timeout_s=busy_timeout_s), busy_timeout_s=busy_timeout_s)

    def close(self) -> None:
        self._conn.close()

    def checkpoint_at(self, pages: int) -> None:
        """Let a commit checkpoint SQLite's log by itself only past ``pages`` (the
        :class:`~trainpod.store.walcheckpoint.WalCheckpointer` folds it before)."""
        self._conn.execute(f"PRAGMA wal_autocheckpoint = {int(pages)}")

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Run the block in one write transaction (nested calls join the outer one)."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:  # a lock held elsewhere past the timeout
            raise self._unavailable(exc) from exc
        self._depth = 1
        self._lost = None
        try:
            yield
            if self._lost is not None:  # SQLite rolled the whole transaction back
                raise self._lost
            self._conn.execute("COMMIT")
        except BaseException as exc:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            self.work_version += 1
            self._nodes.drop()
            if (translated := self._unavailable(exc)) is exc:
                raise
            raise translated from exc
        finally:
            self._depth = 0
            self._lost = None

    def _unavailable(self, exc: BaseException) -> BaseException:
        """``exc``, or the :class:`StoreUnavailable` it means (a lock, a full disk)."""
        return unavailable(exc, self._path, self._busy_timeout_s) or exc

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        """Inside :meth:`transaction`: the block's writes are undone if it raises, the
        transaction's others kept (one heartbeat of a batch committed together).

        A full disk can make SQLite roll back the whole transaction, not only the block: the
        transaction is then lost, and every later block of it fails with the same error
        instead of running outside any transaction."""
        if not self._depth:
            raise RuntimeError("Store.savepoint() needs an open Store.transaction()")
        if self._lost is not None:
            raise self._lost
        self._conn.execute("SAVEPOINT block")
        try:
            yield
        except BaseException as exc:
            self.work_version += 1
            self._nodes.drop()
            translated = self._unavailable(exc)
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK TO block")
                self._conn.execute("RELEASE block")
            else:
                self._lost = translated
            if translated is exc:
                raise
            raise translated from exc
        else:
            self._conn.execute("RELEASE block")

    # -- meta ---------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self._conn.execute(
            "INSERT INTO meta(key, value) VALUES(?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    # -- events -------------------------------------------------------------------------
    def add_event(
        self,
        ts: float,
        kind: str,
        *,
        node: str | None = None,
        job_id: int | None = None,
        attempt: int | None = None,
        **data: Any,
    ) -> int:
        """Append an event given as its kind and payload, as rows were written before typed
        events: for tests and benchmarks that write raw rows. Producers use :meth:`append`."""
        return self._insert_event(ts, kind, node, job_id, attempt, data)

    def append(self, ts: float, event: Event) -> int:
        """Append ``event`` to the log (at ``ts``); return its id. The row is exactly what
        :meth:`add_event` writes for the same kind and payload."""
        node, job_id, attempt = event.columns()
        return self._insert_event(ts, event.kind, node, job_id, attempt, event.to_row_data())

    def _insert_event(
        self,
        ts: float,
        kind: str,
        node: str | None,
        job_id: int | None,
        attempt: int | None,
        data: dict[str, Any],
    ) -> int:
        cur = self._conn.execute(
            "INSERT INTO events(ts, kind, node, job_id, attempt, data) VALUES(?,?,?,?,?,?)",
            (ts, kind, node, job_id, attempt, json.dumps(data, sort_keys=True, default=str)),
        )
        self.appended += 1
        return int(cur.lastrowid or 0)

    def events(
        self,
        *,
        job_id: int | None = None,
        node: str | None = None,
        after: int = 0,
        limit: int | None = None,
    ) -> list[EventRow]:
        sql = "SELECT * FROM events WHERE id > ?"
        args: list[Any] = [after]
        if job_id is not None:
            sql += " AND job_id = ?"
            args.append(job_id)
        if node is not None:
            sql += " AND node = ?"
            args.append(node)
        sql += " ORDER BY id"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        return [EventRow.from_sql(r) for r in self._conn.execute(sql, args)]

    def typed_events(
        self,
        *,
        job_id: int | None = None,
        node: str | None = None,
        after: int = 0,
        limit: int | None = None,
    ) -> list[Recorded]:
        """:meth:`events`, each parsed into its event type (see ``trainpod.model.events``)."""
        rows = self.events(job_id=job_id, node=node, after=after, limit=limit)
        return [recorded(r) for r in rows]

    def prune_events(self, now: float, keep_days: float) -> int:
        """Delete the events older than ``keep_days`` days, except every event of a job that
        has not ended; return how many were deleted. Idempotent.

        The log is append-only by trigger: a delete is refused unless the ``prune_before``
        meta row, set only here and only for this transaction, allows it, and even then an
        event of a live job is kept (see migration 4)."""
        cutoff = now - keep_days * 86_400.0
        ended = [s.value for s in JobState if s.ended]
        with self.transaction():
            self.set_meta("prune_before", repr(cutoff))
            cur = self._conn.execute(
                "DELETE FROM events WHERE ts < ? AND (job_id IS NULL OR job_id NOT IN "
                f"(SELECT id FROM jobs WHERE state NOT IN ({','.join('?' * len(ended))})))",
                [cutoff, *ended],
            )
            self._conn.execute("DELETE FROM meta WHERE key = 'prune_before'")
        return int(cur.rowcount)

    def has_event(self, job_id: int, kind: str, attempt: int | None = None) -> bool:
        row = self._conn.execute(
            "SELECT 1 FROM events WHERE job_id = ? AND kind = ? AND attempt IS ? LIMIT 1",
            (job_id, kind, attempt),
        ).fetchone()
        return row is not None

    def fault_history(self) -> tuple[int, float | None]:
        """How many ``fault_detected`` events there are, and the time of the first event."""
        row = self._conn.execute(
            "SELECT (SELECT COUNT(*) FROM events WHERE kind = ?), (SELECT MIN(ts) FROM events)",
            (FaultDetected.kind,),
        ).fetchone()
        return int(row[0]), row[1]

    def count_events(self, job_id: int, kind: str) -> int:
        row = self._conn.execute(
            "SELECT COUNT(*) FROM events WHERE job_id = ? AND kind = ?", (job_id, kind)
        ).fetchone()
        return int(row[0])

    # -- nodes --------------------------------------------------------------------------
    def insert_node(
        self, name: str, group: str, role: str, spare: bool, devices: int, ts: float
    ) -> None:
        self._conn.execute(
            "INSERT INTO nodes(name, grp, role, spare, devices, state, updated_at) "
            "VALUES(?,?,?,?,?,?,?)",
            (name, group, role, int(spare), devices, NodeState.PROVISIONING.value, ts),
        )
        self._nodes.drop()

    def node(self, name: str) -> NodeRow | None:
        """The node's row (kept in memory: :mod:`trainpod.store.nodecache`)."""
        return self._nodes.rows().get(name)

    def nodes(self) -> list[NodeRow]:
        return list(self._nodes.rows().values())

    def _read_nodes(self) -> list[NodeRow]:
        return [NodeRow.from_sql(r) for r in self._conn.execute("SELECT * FROM nodes")]

    def _read_node(self, name: str) -> NodeRow | None:
        r = self._conn.execute("SELECT * FROM nodes WHERE name = ?", (name,)).fetchone()
        return None if r is None else NodeRow.from_sql(r)

    def nodes_in(self, states: Sequence[NodeState]) -> list[NodeRow]:
        """The nodes in ``states`` (the reconcile loop's passes look at few of many), from
        the kept table: a scan of SQLite's rows, ~2 KB of facts each, under the
        controller's lock at every step, held up the heartbeats behind it."""
        wanted = set(states)
        return [r for r in self._nodes.rows().values() if r.state in wanted]

    def silent_nodes(self, since: float) -> list[NodeRow]:
        """Nodes with an agent whose last heartbeat is older than ``since`` (kept table)."""
        return [
            r
            for r in self._nodes.rows().values()
            if r.agent_id is not None and r.last_heartbeat is not None and r.last_heartbeat < since
        ]

    def update_node(self, name: str, ts: float, **fields: Any) -> None:
        sets, args = _sets(fields, _NODE_COLUMNS)
        self._conn.execute(
            f"UPDATE nodes SET {sets}, updated_at = ? WHERE name = ?", [*args, ts, name]
        )
        self._nodes.written(self._node_after(name, ts, fields), name)

    def _node_after(self, name: str, ts: float, fields: dict[str, Any]) -> NodeRow | None:
        """The row as just written: the kept row with the plain columns a heartbeat writes
        set as SQLite reads them back (every agent's beat, a thousand a second: reading the
        row back was a quarter of a beat's cost); read back for any other column."""
        kept = self._nodes.kept(name)
        if kept is None or not fields.keys() <= _PLAIN_NODE.keys():
            return self._read_node(name)
        plain: dict[str, Any] = {}
        for column, value in fields.items():
            attr, kind = _PLAIN_NODE[column]
            if value is not None and type(value) is not kind:
                if kind is not float or type(value) is not int:
                    return self._read_node(name)
                value = float(value)  # a REAL column reads an int back as a float
            plain[attr] = value
        return replace(kept, updated_at=float(ts), **plain)

    def touch_heartbeats(self, ts: float) -> None:
        """Give every node a fresh heartbeat time (used when the controller restarts)."""
        self._conn.execute("UPDATE nodes SET last_heartbeat = ?", (ts,))
        self._nodes.drop()

    # -- jobs ---------------------------------------------------------------------------
    def insert_job(self, name: str, spec: dict[str, Any], ts: float) -> int:
        self.work_version += 1
        cur = self._conn.execute(
            "INSERT INTO jobs(name, spec, state, submitted_at, updated_at) VALUES(?,?,?,?,?)",
            (name, json.dumps(spec, sort_keys=True), JobState.QUEUED.value, ts, ts),
        )
        return int(cur.lastrowid or 0)

    def job(self, job_id: int) -> JobRow | None:
        r = self._conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if r is None else JobRow.from_sql(r)

    def jobs(
        self, states: Sequence[JobState] | None = None, limit: int | None = None
    ) -> list[JobRow]:
        return [JobRow.from_sql(r) for r in self._select_jobs("*", states, limit)]

    def _select_jobs(
        self,
        columns: str,
        states: Sequence[JobState] | None,
        limit: int | None,
        after: int | None = None,
    ) -> sqlite3.Cursor:
        """``columns`` of the jobs in ``states`` (None: all), oldest first; with ``limit``,
        the newest ``limit`` of them. With ``after``, only ids above it, and ``limit`` keeps
        the first ``limit`` of those: a page, by key (no OFFSET scan however deep)."""
        where: list[str] = []
        args: list[Any] = []
        if states is not None:
            where.append(f"state IN ({','.join('?' * len(states))})")
            args.extend(s.value for s in states)
        if after is not None:
            where.append("id > ?")
            args.append(after)
        sql = f"SELECT {columns} FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id"
        if limit is not None and after is not None:
            sql += " LIMIT ?"
            args.append(limit)
        elif limit is not None:
            sql = f"SELECT * FROM ({sql} DESC LIMIT ?) ORDER BY id"
            args.append(limit)
        return self._conn.execute(sql, args)

    def job_heads(
        self,
        states: Sequence[JobState] | None = None,
        limit: int | None = None,
        after: int | None = None,
    ) -> list[tuple[int, JobState, float, float | None]]:
        """(id, state, updated_at, ended_at) of the jobs :meth:`jobs` would return, in the
        same order, without reading their specs: list views decide what to rebuild. With
        ``after``: only ids above it, and ``limit`` keeps the first of them (a page)."""
        rows = self._select_jobs("id, state, updated_at, ended_at", states, limit, after)
        return [(int(r[0]), JobState(r[1]), r[2], r[3]) for r in rows]

    def jobs_before(
        self, states: Sequence[JobState], before: int | None, limit: int
    ) -> list[JobRow]:
        """Up to ``limit`` jobs in ``states`` with an id below ``before`` (None: any), newest
        first: one page of a history, by key (no OFFSET scan however deep the page)."""
        sql = f"SELECT * FROM jobs WHERE state IN ({','.join('?' * len(states))})"
        args: list[Any] = [s.value for s in states]
        if before is not None:
            sql += " AND id < ?"
            args.append(before)
        rows = self._conn.execute(sql + " ORDER BY id DESC LIMIT ?", [*args, limit])
        return [JobRow.from_sql(r) for r in rows]

    def jobs_by_id(self, job_ids: Sequence[int]) -> list[JobRow]:
        """The jobs ``job_ids`` in one query, by id."""
        if not job_ids:
            return []
        rows = self._conn.execute(
            "SELECT j.* FROM jobs j JOIN json_each(?) i ON j.id = i.value ORDER BY j.id",
            (json.dumps(list(job_ids)),),
        )
        return [JobRow.from_sql(r) for r in rows]

    def job_ids(self, states: Sequence[JobState]) -> list[int]:
        """Ids of the jobs in ``states``, oldest first (no spec parsing)."""
        rows = self._conn.execute(
            f"SELECT id FROM jobs WHERE state IN ({','.join('?' * len(states))}) ORDER BY id",
            [s.value for s in states],
        )
        return [int(r[0]) for r in rows]

    def update_job(self, job_id: int, ts: float, **fields: Any) -> None:
        sets, args = _sets(fields, _JOB_COLUMNS)
        self.work_version += 1
        self._conn.execute(
            f"UPDATE jobs SET {sets}, updated_at = ? WHERE id = ?", [*args, ts, job_id]
        )

    # -- attempts and ranks -------------------------------------------------------------
    def insert_attempt(
        self,
        job_id: int,
        number: int,
        nodes: list[str],
        master_addr: str,
        master_port: int,
        procs_per_node: int,
        ts: float,
        restart_reason: str = "",
        lent_by: tuple[int, ...] = (),
    ) -> int:
        self.work_version += 1
        cur = self._conn.execute(
            "INSERT INTO attempts(job_id, number, state, nodes, master_addr, master_port, "
            "created_at, restart_reason, lent_by) VALUES(?,?,?,?,?,?,?,?,?)",
            (
                job_id,
                number,
                AttemptState.LAUNCHING.value,
                json.dumps(nodes),
                master_addr,
                master_port,
                ts,
                restart_reason,
                json.dumps(list(lent_by)),
            ),
        )
        attempt_id = int(cur.lastrowid or 0)
        self._conn.executemany(
            "INSERT INTO ranks(attempt_id, rank, node, local_rank, state) VALUES(?,?,?,?,?)",
            [
                (
                    attempt_id,
                    group_rank * procs_per_node + local,
                    node,
                    local,
                    RankState.PENDING.value,
                )
                for group_rank, node in enumerate(nodes)
                for local in range(procs_per_node)
            ],
        )
        return attempt_id

    def attempt(self, attempt_id: int) -> AttemptRow | None:
        r = self._conn.execute("SELECT * FROM attempts WHERE id = ?", (attempt_id,)).fetchone()
        return None if r is None else AttemptRow.from_sql(r)

    def attempts(self, job_id: int) -> list[AttemptRow]:
        rows = self._conn.execute(
            "SELECT * FROM attempts WHERE job_id = ? ORDER BY number", (job_id,)
        )
        return [AttemptRow.from_sql(r) for r in rows]

    def active_attempts(self) -> list[AttemptRow]:
        """Attempts not ended, oldest first: by ``attempts_state`` (an ``IN`` of the live
        states, which the index serves; a ``NOT IN`` of the ended ones scans every row)."""
        live = [s.value for s in AttemptState if not s.ended]
        rows = self._conn.execute(
            f"SELECT * FROM attempts WHERE state IN ({','.join('?' * len(live))}) ORDER BY id",
            live,
        )
        return [AttemptRow.from_sql(r) for r in rows]

    def usage_since(self, since: float) -> list[tuple[int, str, int, float, float | None]]:
        """(attempt id, team, nodes, held from, held until or None) of every attempt that
        held nodes after ``since``: the fair-share input. The team is the job's spec's."""
        rows = self._conn.execute(
            "SELECT a.id, json_extract(j.spec, '$.team'), json_array_length(a.nodes), "
            "a.created_at, a.ended_at FROM attempts a JOIN jobs j ON j.id = a.job_id "
            "WHERE a.ended_at IS NULL OR a.ended_at >= ?",
            (since,),
        )
        return [(int(i), str(t or ""), int(n or 0), float(c), e) for i, t, n, c, e in rows]

    def last_checkpoints(self, job_ids: Sequence[int]) -> dict[int, float]:
        """Job -> when its newest checkpoint was saved or committed (from the events)."""
        if not job_ids:
            return {}
        marks = ",".join("?" * len(job_ids))
        rows = self._conn.execute(
            f"SELECT job_id, MAX(ts) FROM events WHERE job_id IN ({marks}) "
            "AND kind IN ('checkpoint_saved', 'checkpoint_committed') GROUP BY job_id",
            list(job_ids),
        )
        return {int(j): float(t) for j, t in rows}

    def attempts_of_jobs(self, job_ids: Sequence[int]) -> dict[int, list[AttemptRow]]:
        """Every attempt of ``job_ids`` in one query (list views), by job, oldest first."""
        out: dict[int, list[AttemptRow]] = {j: [] for j in job_ids}
        if not job_ids:
            return out
        rows = self._conn.execute(
            "SELECT a.* FROM attempts a JOIN json_each(?) j ON a.job_id = j.value "
            "ORDER BY a.job_id, a.number",
            (json.dumps(list(job_ids)),),
        )
        for r in rows:
            a = AttemptRow.from_sql(r)
            out[a.job_id].append(a)
        return out

    def ranks_of_attempts(self, attempt_ids: Sequence[int]) -> dict[int, list[RankRow]]:
        """Every rank of ``attempt_ids`` in one query (list views), by attempt, in order."""
        out: dict[int, list[RankRow]] = {a: [] for a in attempt_ids}
        if not attempt_ids:
            return out
        rows = self._conn.execute(
            "SELECT r.* FROM ranks r JOIN json_each(?) j ON r.attempt_id = j.value "
            "ORDER BY r.attempt_id, r.rank",
            (json.dumps(list(attempt_ids)),),
        )
        for r in rows:
            rank = RankRow.from_sql(r)
            out[rank.attempt_id].append(rank)
        return out

    def live_jobs_on(self, node: str, states: Sequence[JobState]) -> list[int]:
        """Jobs in ``states`` with an attempt that ran (or runs) on ``node``, in one query."""
        rows = self._conn.execute(
            "SELECT DISTINCT a.job_id FROM attempts a JOIN jobs j ON j.id = a.job_id "
            f"WHERE j.state IN ({','.join('?' * len(states))}) "
            "AND EXISTS (SELECT 1 FROM json_each(a.nodes) n WHERE n.value = ?) ORDER BY a.job_id",
            [*(s.value for s in states), node],
        )
        return [int(r[0]) for r in rows]

    def live_jobs_by_node(self, states: Sequence[JobState]) -> dict[str, list[int]]:
        """:meth:`live_jobs_on` for every node at once (nodes without such jobs left out)."""
        rows = self._conn.execute(
            "SELECT DISTINCT n.value, a.job_id FROM attempts a JOIN jobs j ON j.id = a.job_id, "
            f"json_each(a.nodes) n WHERE j.state IN ({','.join('?' * len(states))}) "
            "ORDER BY a.job_id",
            [s.value for s in states],
        )
        out: dict[str, list[int]] = {}
        for node, job_id in rows:
            out.setdefault(str(node), []).append(int(job_id))
        return out

    def update_attempt(self, attempt_id: int, **fields: Any) -> None:
        sets, args = _sets(fields, _ATTEMPT_COLUMNS)
        self.work_version += 1
        self._conn.execute(f"UPDATE attempts SET {sets} WHERE id = ?", [*args, attempt_id])

    def ranks(self, attempt_id: int) -> list[RankRow]:
        rows = self._conn.execute(
            "SELECT * FROM ranks WHERE attempt_id = ? ORDER BY rank", (attempt_id,)
        )
        return [RankRow.from_sql(r) for r in rows]

    def update_rank(self, attempt_id: int, rank: int, **fields: Any) -> None:
        sets, args = _sets(fields, _RANK_COLUMNS)
        self.work_version += 1
        self._conn.execute(
            f"UPDATE ranks SET {sets} WHERE attempt_id = ? AND rank = ?",
            [*args, attempt_id, rank],
        )
