"""The SQLite store: migrations, append-only events, transactions, durability."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainpod.errors import Fatal
from trainpod.model.failures import Failure
from trainpod.model.states import AttemptState, JobState, NodeState, RankState
from trainpod.store.db import migrate, open_db, schema_version
from trainpod.store.migrations import MIGRATIONS
from trainpod.store.repo import Store


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    c = open_db(tmp_path / "state.db")
    yield c
    c.close()


@pytest.fixture
def store(conn: sqlite3.Connection) -> Store:
    return Store(conn)


def tables(conn: sqlite3.Connection) -> set[str]:
    rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
    return {r[0] for r in rows} - {"sqlite_sequence"}


# -- migrations ----------------------------------------------------------------------------
def test_a_new_database_is_at_the_latest_version(conn: sqlite3.Connection) -> None:
    assert schema_version(conn) == len(MIGRATIONS) >= 1
    assert int(conn.execute("PRAGMA user_version").fetchone()[0]) == len(MIGRATIONS)
    assert {"meta", "nodes", "jobs", "attempts", "ranks", "events"} <= tables(conn)


def test_migrations_are_idempotent(conn: sqlite3.Connection, tmp_path: Path) -> None:
    before = tables(conn)
    assert migrate(conn) == len(MIGRATIONS)
    assert migrate(conn) == len(MIGRATIONS)
    assert tables(conn) == before
    conn.close()
    again = open_db(tmp_path / "state.db")  # opening migrates again: a no-op
    assert schema_version(again) == len(MIGRATIONS)
    again.close()


def test_migrating_from_an_empty_database_step_by_step(tmp_path: Path) -> None:
    raw = sqlite3.connect(str(tmp_path / "raw.db"), isolation_level=None)
    assert schema_version(raw) == 0
    assert migrate(raw) == len(MIGRATIONS)
    assert "events" in tables(raw)
    raw.close()


def test_a_database_from_a_newer_trainpod_is_refused(tmp_path: Path) -> None:
    raw = sqlite3.connect(str(tmp_path / "new.db"), isolation_level=None)
    raw.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    raw.close()
    with pytest.raises(Fatal, match="upgrade trainpod"):
        open_db(tmp_path / "new.db")


def test_a_file_database_uses_wal_and_foreign_keys(conn: sqlite3.Connection) -> None:
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1


def test_foreign_keys_are_enforced(store: Store) -> None:
    with pytest.raises(sqlite3.IntegrityError), store.transaction():
        store.insert_attempt(999, 1, ["n-0"], "127.0.0.1", 1, 1, 0.0)


# -- events are append-only ----------------------------------------------------------------
def test_events_are_appended_in_order(store: Store) -> None:
    with store.transaction():
        a = store.add_event(1.0, "node_declared", node="n-0", group="g")
        b = store.add_event(2.0, "job_submitted", job_id=4, nodes=2, command=["python", "x"])
        c = store.add_event(3.0, "rank_exited", node="n-0", job_id=4, attempt=1, rank=0)
    assert a < b < c
    events = store.events()
    assert [e.id for e in events] == [a, b, c]
    assert events[1].data == {"nodes": 2, "command": ["python", "x"]}
    assert (events[2].node, events[2].job_id, events[2].attempt) == ("n-0", 4, 1)
    assert [e.id for e in store.events(job_id=4)] == [b, c]
    assert [e.id for e in store.events(node="n-0")] == [a, c]
    assert [e.id for e in store.events(after=a, limit=1)] == [b]


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE events SET kind = 'forged'",
        "UPDATE events SET ts = ts + 1 WHERE id = 1",
        "DELETE FROM events",
        "DELETE FROM events WHERE id = 1",
    ],
)
def test_events_cannot_be_changed_or_deleted(conn: sqlite3.Connection, sql: str) -> None:
    store = Store(conn)
    with store.transaction():
        store.add_event(1.0, "controller_started", restarted=False)
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        conn.execute(sql)
    assert [e.kind for e in store.events()] == ["controller_started"]


def test_a_failed_event_change_rolls_back_its_transaction(conn: sqlite3.Connection) -> None:
    store = Store(conn)
    with store.transaction():
        store.add_event(1.0, "first")
    with pytest.raises(sqlite3.DatabaseError), store.transaction():
        store.add_event(2.0, "second")
        conn.execute("DELETE FROM events")
    assert [e.kind for e in store.events()] == ["first"]


# -- transactions --------------------------------------------------------------------------
class Boom(Exception):
    pass


def test_a_rolled_back_transaction_keeps_nothing(store: Store) -> None:
    with pytest.raises(Boom), store.transaction():
        store.insert_node("n-0", "g", "compute", False, 2, 1.0)
        job = store.insert_job("j", {"command": ["x"]}, 1.0)
        store.insert_attempt(job, 1, ["n-0"], "127.0.0.1", 29500, 2, 1.0)
        store.add_event(1.0, "job_submitted", job_id=job)
        store.set_meta("k", "v")
        raise Boom
    assert store.nodes() == []
    assert store.jobs() == []
    assert store.events() == []
    assert store.get_meta("k") is None


def test_nested_transactions_join_the_outer_one(store: Store) -> None:
    with pytest.raises(Boom), store.transaction():
        with store.transaction():
            store.add_event(1.0, "inner")
        store.add_event(2.0, "outer")
        raise Boom
    assert store.events() == []
    with store.transaction():
        with store.transaction():
            store.add_event(1.0, "inner")
        store.add_event(2.0, "outer")
    assert [e.kind for e in store.events()] == ["inner", "outer"]


def test_a_savepoint_undoes_only_its_own_block(store: Store) -> None:
    with store.transaction():
        store.add_event(1.0, "kept")
        with pytest.raises(Boom), store.savepoint():
            store.add_event(2.0, "undone")
            store.insert_job("j", {"command": ["x"]}, 2.0)
            raise Boom
        with store.savepoint():
            store.add_event(3.0, "also kept")
    assert [e.kind for e in store.events()] == ["kept", "also kept"]
    assert store.jobs() == []
    with pytest.raises(RuntimeError, match="needs an open"), store.savepoint():
        pass


def test_work_version_moves_on_job_attempt_and_rank_writes_and_rollbacks(store: Store) -> None:
    seen = [store.work_version]

    def moved() -> bool:
        seen.append(store.work_version)
        return seen[-1] != seen[-2]

    store.insert_node("n-0", "g", "compute", False, 2, 1.0)
    store.update_node("n-0", 2.0, last_heartbeat=2.0)
    store.add_event(2.0, "beat")
    assert not moved()  # a beat's own writes leave what orders are made of alone
    job = store.insert_job("j", {"command": ["x"]}, 1.0)
    assert moved()
    attempt = store.insert_attempt(job, 1, ["n-0"], "127.0.0.1", 29500, 1, 1.0)
    assert moved()
    store.update_rank(attempt, 0, state=RankState.RUNNING)
    assert moved()
    store.update_attempt(attempt, state=AttemptState.RUNNING)
    assert moved()
    store.update_job(job, 2.0, state=JobState.RUNNING)
    assert moved()
    with pytest.raises(Boom), store.transaction():
        raise Boom  # what was read inside may have been undone
    assert moved()


def test_the_store_is_usable_after_a_rollback(store: Store) -> None:
    with pytest.raises(Boom), store.transaction():
        raise Boom
    with store.transaction():
        store.add_event(1.0, "after")
    assert len(store.events()) == 1


def test_writes_are_visible_to_another_connection_only_after_commit(
    store: Store, tmp_path: Path
) -> None:
    other = open_db(tmp_path / "state.db")
    try:
        with store.transaction():
            store.add_event(1.0, "pending")
            assert other.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 0
        assert other.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 1
    finally:
        other.close()


# -- the repository ------------------------------------------------------------------------
def test_nodes_round_trip(store: Store) -> None:
    with store.transaction():
        store.insert_node("n-0", "workers", "compute", True, 4, 1.0)
        store.update_node("n-0", 2.0, state=NodeState.IDLE, facts={"cpus": 8}, agent_id="a")
    node = store.node("n-0")
    assert node is not None
    assert (node.group, node.role, node.spare, node.devices) == ("workers", "compute", True, 4)
    assert (node.state, node.facts, node.agent_id, node.updated_at) == (
        NodeState.IDLE,
        {"cpus": 8},
        "a",
        2.0,
    )
    assert store.node("nope") is None
    with pytest.raises(ValueError, match="cannot update columns"):
        store.update_node("n-0", 3.0, grp="evil")


def test_jobs_attempts_and_ranks_round_trip(store: Store) -> None:
    with store.transaction():
        job = store.insert_job("train", {"command": ["python"], "nodes": 2}, 1.0)
        aid = store.insert_attempt(job, 1, ["n-0", "n-1"], "10.0.0.1", 29500, 2, 1.0)
        store.update_rank(aid, 3, state=RankState.EXITED, exit_code=1, ended_at=4.0)
        store.update_attempt(aid, state=AttemptState.STOPPING, failure=Failure(rank=3).to_json())
        store.update_job(job, 5.0, state=JobState.STOPPING, cancel_requested=True)
    row = store.job(job)
    assert row is not None
    assert (row.state, row.cancel_requested, row.spec["nodes"]) == (JobState.STOPPING, True, 2)
    att = store.attempt(aid)
    assert att is not None
    assert (att.nodes, att.master_port, att.failure) == (["n-0", "n-1"], 29500, Failure(rank=3))
    assert [a.id for a in store.active_attempts()] == [aid]
    ranks = store.ranks(aid)
    assert [(r.rank, r.node, r.local_rank) for r in ranks] == [
        (0, "n-0", 0),
        (1, "n-0", 1),
        (2, "n-1", 0),
        (3, "n-1", 1),
    ]
    assert [r.state for r in ranks] == [RankState.PENDING] * 3 + [RankState.EXITED]
    assert ranks[3].failed and not ranks[0].failed
    with store.transaction():
        store.update_attempt(aid, state=AttemptState.FAILED)
    assert store.active_attempts() == []


def test_jobs_filter_and_limit_keep_id_order(store: Store) -> None:
    with store.transaction():
        ids = [store.insert_job(f"j{i}", {"command": ["x"]}, float(i)) for i in range(5)]
        store.update_job(ids[1], 9.0, state=JobState.COMPLETED)
    assert [j.id for j in store.jobs()] == ids
    assert [j.id for j in store.jobs([JobState.QUEUED])] == [ids[0], *ids[2:]]
    assert [j.id for j in store.jobs(limit=2)] == ids[-2:]  # the newest two, oldest first
    assert store.jobs([JobState.RUNNING]) == []


def test_job_heads_come_a_page_at_a_time_after_a_cursor(store: Store) -> None:
    with store.transaction():
        ids = [store.insert_job(f"j{i}", {"command": ["x"]}, float(i)) for i in range(5)]
        store.update_job(ids[1], 9.0, state=JobState.COMPLETED)

    def heads(**kw: Any) -> list[int]:
        return [h[0] for h in store.job_heads(**kw)]

    assert heads(after=0, limit=2) == ids[:2]
    assert heads(after=ids[1], limit=2) == ids[2:4]
    assert heads(after=ids[3], limit=2) == ids[4:]
    assert heads(after=ids[4], limit=2) == []
    assert heads(after=ids[2]) == ids[3:]
    assert heads(states=[JobState.QUEUED], after=ids[0], limit=2) == ids[2:4]
    assert heads(limit=2) == ids[-2:]  # no cursor: the newest two, oldest first


# -- durability ----------------------------------------------------------------------------
def test_reopening_a_file_database_keeps_everything(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = Store.open(path)
    with store.transaction():
        store.insert_node("n-0", "g", "compute", False, 2, 1.0)
        job = store.insert_job("j", {"command": ["x"]}, 1.0)
        store.add_event(1.0, "job_submitted", job_id=job)
        store.set_meta("started_at", "1.0")
    store.close()

    again = Store.open(path)
    try:
        assert [n.name for n in again.nodes()] == ["n-0"]
        assert [j.id for j in again.jobs()] == [job]
        assert [e.kind for e in again.events()] == ["job_submitted"]
        assert again.get_meta("started_at") == "1.0"
        with again.transaction():
            later = again.add_event(2.0, "controller_started")
        assert later > again.events()[0].id
    finally:
        again.close()


def test_meta_upserts(store: Store) -> None:
    with store.transaction():
        store.set_meta("k", "1")
        store.set_meta("k", "2")
    assert store.get_meta("k") == "2"


def test_the_scheduling_pass_reads_attempts_by_index_not_by_scan(
    store: Store, conn: sqlite3.Connection
) -> None:
    """Every pass reads the live attempts and the ones that held nodes lately (fair share);
    neither may scan every attempt the cluster ever ran (migration 12)."""
    with store.transaction():
        ids = []
        for i, state in enumerate(AttemptState):
            job = store.insert_job(f"j{i}", {"command": ["x"], "team": "a"}, float(i))
            ids.append(store.insert_attempt(job, 1, [f"n-{i}"], "h", 29500, 1, float(i)))
            ended = {"ended_at": 10.0 + i} if state.ended else {}
            store.update_attempt(ids[-1], state=state, **ended)
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    live = store.active_attempts()
    lately = store.usage_since(14.0)  # succeeded ended at 13, failed 14, cancelled 15
    conn.set_trace_callback(None)
    assert [a.state for a in live] == [s for s in AttemptState if not s.ended]
    assert [a.id for a in live] == sorted(a.id for a in live)
    by_state = dict(zip(AttemptState, ids, strict=True))
    late = [by_state[s] for s in AttemptState if s is not AttemptState.SUCCEEDED]
    assert sorted(row[0] for row in lately) == late
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert len(selects) == 2, statements
    for sql in selects:
        plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}")]
        assert not [step for step in plan if step.startswith("SCAN")], (sql, plan)
