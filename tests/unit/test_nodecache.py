"""The nodes table kept in memory by the store: what it reads is always what SQLite holds."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainpod.model.states import NodeState
from trainpod.store.db import open_db
from trainpod.store.nodecache import NodeCache
from trainpod.store.repo import Store
from trainpod.store.rows import NodeRow


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    conn = open_db(tmp_path / "state.db")
    s = Store(conn)
    with s.transaction():
        for i in range(3):
            s.insert_node(f"n{i}", "g", "compute", False, 1, 1.0)
    yield s
    conn.close()


def from_table(store: Store, name: str) -> NodeRow:
    """The row as SQLite has it, bypassing the kept copy."""
    conn: sqlite3.Connection = store.connection
    row = conn.execute("SELECT * FROM nodes WHERE name = ?", (name,)).fetchone()
    return NodeRow.from_sql(row)


def state(store: Store, name: str) -> NodeState:
    row = store.node(name)
    assert row is not None
    return row.state


def test_a_write_is_seen_by_the_next_read(store: Store) -> None:
    assert [n.name for n in store.nodes()] == ["n0", "n1", "n2"]
    with store.transaction():
        store.update_node("n1", 2.0, state=NodeState.IDLE, last_heartbeat=2.0, facts='{"a":1}')
    assert store.node("n1") == from_table(store, "n1")
    assert from_table(store, "n1").facts == {"a": 1}
    assert [n.state for n in store.nodes()] == [
        NodeState.PROVISIONING,
        NodeState.IDLE,
        NodeState.PROVISIONING,
    ]


def test_a_rolled_back_write_is_not_seen(store: Store) -> None:
    store.nodes()  # loaded
    with pytest.raises(RuntimeError), store.transaction():
        store.update_node("n0", 2.0, state=NodeState.SUSPECT)
        assert state(store, "n0") is NodeState.SUSPECT
        raise RuntimeError("undo")
    assert store.node("n0") == from_table(store, "n0")
    assert state(store, "n0") is NodeState.PROVISIONING


def test_a_failed_savepoint_undoes_only_its_own_write(store: Store) -> None:
    store.nodes()
    with store.transaction():
        store.update_node("n0", 2.0, state=NodeState.IDLE)
        with pytest.raises(RuntimeError), store.savepoint():
            store.update_node("n1", 2.0, state=NodeState.SUSPECT)
            raise RuntimeError("undo this beat")
    assert state(store, "n0") is NodeState.IDLE
    assert state(store, "n1") is NodeState.PROVISIONING
    assert store.nodes() == [from_table(store, n) for n in ("n0", "n1", "n2")]


def test_inserts_and_bulk_writes_are_seen(store: Store) -> None:
    store.nodes()
    with store.transaction():
        store.insert_node("n3", "g", "compute", False, 1, 3.0)
        assert store.node("n3") is not None
        store.touch_heartbeats(9.0)
    assert [n.last_heartbeat for n in store.nodes()] == [9.0] * 4
    assert store.node("nope") is None


def test_a_load_that_a_write_overtook_is_not_kept() -> None:
    """A reader outside the controller's lock loads the table while a write lands: what it
    read may predate the write, so it is used once and not kept."""
    loads: list[int] = []
    old = NodeRow("n0", "g", "compute", False, 1, NodeState.IDLE, "", None, None, None, None,
                  None, "{}", 1.0)  # fmt: skip
    new = NodeRow("n0", "g", "compute", False, 1, NodeState.SUSPECT, "", None, None, None, None,
                  None, "{}", 2.0)  # fmt: skip
    cache: NodeCache

    def load() -> list[NodeRow]:
        loads.append(1)
        if len(loads) == 1:
            cache.written(new, "n0")  # the write lands while this load reads
            return [old]
        return [new]

    cache = NodeCache(load)
    assert cache.rows()["n0"] is old  # this reader got what it read
    assert cache.rows()["n0"] is new  # but it was not kept: the next read loads again
    assert len(loads) == 2
    assert cache.rows()["n0"] is new and len(loads) == 2  # now kept
