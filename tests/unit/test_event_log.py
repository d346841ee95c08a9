"""The event log's indexes and retention (migration 4): old events go, a live job's stay."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainpod.model.events import ControllerStarted, JobStateChanged, NodeDeclared
from trainpod.model.states import JobState
from trainpod.store.db import migrate, open_db, schema_version
from trainpod.store.migrations import MIGRATIONS
from trainpod.store.repo import Store

DAY = 86_400.0
NOW = 100 * DAY


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "state.db")
    yield s
    s.close()


def job(store: Store, state: JobState, ts: float) -> int:
    job_id = store.insert_job("j", {"command": ["x"]}, ts)
    store.update_job(job_id, ts, state=state)
    return job_id


def plan(conn: sqlite3.Connection, sql: str, *args: object) -> str:
    return " ".join(r[-1] for r in conn.execute(f"EXPLAIN QUERY PLAN {sql}", args))


def test_a_version_3_database_migrates_keeping_its_events(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    raw = sqlite3.connect(str(path), isolation_level=None)
    for version in range(3):  # the schema as trainpod 1369dc0 left it
        raw.executescript(f"BEGIN;{MIGRATIONS[version]}PRAGMA user_version = {version + 1};COMMIT;")
    raw.execute(
        "INSERT INTO events(ts, kind, node, job_id, attempt, data) VALUES "
        "(1.0, 'node_declared', 'n-0', NULL, NULL, '{\"group\": \"g\"}')"
    )
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        raw.execute("DELETE FROM events")
    assert schema_version(raw) == 3
    assert migrate(raw) == len(MIGRATIONS) >= 4
    raw.close()

    store = Store.open(path)
    try:
        (old,) = store.typed_events()
        assert old.event == NodeDeclared(node="n-0", group="g")
        indexes = {r[0] for r in store._conn.execute("SELECT name FROM sqlite_master")}
        assert {"events_kind", "events_node", "events_ts", "events_job_kind"} <= indexes
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            store._conn.execute("DELETE FROM events")
        with store.transaction():
            assert store.prune_events(NOW, keep_days=1) == 1
        assert store.events() == []
    finally:
        store.close()


def test_queries_use_the_indexes(store: Store) -> None:
    c = store._conn
    assert "events_kind" in plan(c, "SELECT COUNT(*) FROM events WHERE kind = 'fault_detected'")
    assert "events_ts" in plan(c, "SELECT MIN(ts) FROM events")
    assert "events_node" in plan(c, "SELECT * FROM events WHERE id > 0 AND node = ?", "n")
    assert "events_job_kind" in plan(
        c, "SELECT COUNT(*) FROM events WHERE job_id = ? AND kind = ?", 1, "job_requeued"
    )


def test_prune_keeps_live_jobs_and_recent_events_and_drops_the_rest(store: Store) -> None:
    old, recent = NOW - 40 * DAY, NOW - 2 * DAY
    with store.transaction():
        live = job(store, JobState.RUNNING, old)
        queued = job(store, JobState.QUEUED, old)
        ended = job(store, JobState.COMPLETED, old)
        for j in (live, queued, ended):
            store.add_event(old, "job_submitted", job_id=j)
            store.append(
                recent, JobStateChanged(job_id=j, old=JobState.QUEUED, new=JobState.RUNNING)
            )
        store.add_event(old, "job_state", job_id=999, old="queued", new="failed")  # no such job
        store.append(old, ControllerStarted(restarted=False))
        store.append(recent, ControllerStarted(restarted=True))
    before = {e.id for e in store.events()}

    assert store.prune_events(NOW, keep_days=30) == 3  # the ended job's, the unknown job's, one
    kept = store.events()
    assert {(e.ts, e.job_id) for e in kept} == {
        (old, live),
        (old, queued),
        *((recent, j) for j in (live, queued, ended)),
        (recent, None),
    }
    assert store.get_meta("prune_before") is None  # retention leaves the log append-only
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        store._conn.execute("DELETE FROM events WHERE ts < ?", (NOW,))
    assert store.prune_events(NOW, keep_days=30) == 0  # idempotent

    with store.transaction():
        store.update_job(live, NOW, state=JobState.FAILED)  # once it ends, its old events go
    assert store.prune_events(NOW, keep_days=30) == 1
    assert {e.id for e in store.events()} < before
    later = store.add_event(NOW, "controller_started", restarted=True)
    assert later > max(before)  # ids are never reused: readers' cursors stay valid


def test_within_a_prune_the_database_still_keeps_live_jobs_events(store: Store) -> None:
    with store.transaction():
        live = job(store, JobState.RUNNING, 0.0)
        store.add_event(0.0, "job_submitted", job_id=live)
        store.add_event(0.0, "controller_started", restarted=False)
        store.add_event(NOW, "controller_started", restarted=True)
    with store.transaction():  # as if prune_events forgot its own filter
        store.set_meta("prune_before", repr(NOW - DAY))
        store._conn.execute("DELETE FROM events")
        store._conn.execute("DELETE FROM meta WHERE key = 'prune_before'")
    assert [(e.kind, e.ts) for e in store.events()] == [
        ("job_submitted", 0.0),
        ("controller_started", NOW),
    ]


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE events SET kind = 'forged'",
        "UPDATE events SET ts = ts - 1000000",
        "DELETE FROM events",
        "DELETE FROM events WHERE ts < 1e12",
    ],
)
def test_outside_a_prune_events_can_neither_change_nor_go(store: Store, sql: str) -> None:
    with store.transaction():
        store.add_event(1.0, "controller_started", restarted=False)
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        store._conn.execute(sql)
    with store.transaction():  # an update is refused even while pruning
        store.set_meta("prune_before", repr(NOW))
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            store._conn.execute("UPDATE events SET kind = 'forged'")
        store._conn.execute("DELETE FROM meta WHERE key = 'prune_before'")
    assert [e.kind for e in store.events()] == ["controller_started"]


def test_a_failed_prune_rolls_back_and_leaves_the_guard_off(tmp_path: Path) -> None:
    conn = open_db(tmp_path / "state.db")
    store = Store(conn)
    with store.transaction():
        store.add_event(1.0, "controller_started", restarted=False)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), store.transaction():
        assert store.prune_events(NOW, keep_days=1) == 1
        raise Boom
    assert len(store.events()) == 1 and store.get_meta("prune_before") is None
    conn.close()


def test_fault_history_counts_faults_since_the_first_event(store: Store) -> None:
    assert store.fault_history() == (0, None)
    with store.transaction():
        store.append(5.0, ControllerStarted(restarted=False))
        for t in (7.0, 9.0):
            store.add_event(t, "fault_detected", job_id=1, attempt=1, fault="crash", fault_at=t)
    assert store.fault_history() == (2, 5.0)
