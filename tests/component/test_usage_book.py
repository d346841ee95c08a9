"""The planner's fair-share input kept incrementally equals the full recomputation."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from trainpod.controller.sharing import UsageBook
from trainpod.scheduler.usage import UsageInterval, decayed_usage
from trainpod.store.repo import Store


def test_the_incremental_usage_equals_reading_every_attempt(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "db.sqlite")
    rng = random.Random(3)
    book = UsageBook(store, half_life_s=300.0)
    live: dict[int, tuple[str, int, float]] = {}
    done: list[UsageInterval] = []
    now = 1000.0
    for _ in range(60):
        with store.transaction():
            for _ in range(rng.randint(0, 3)):  # new attempts start
                team, n = rng.choice("abc"), rng.randint(1, 4)
                spec = json.dumps({"command": ["x"], "team": team})
                job = store.connection.execute(
                    "INSERT INTO jobs(name, spec, state, submitted_at, updated_at) "
                    "VALUES('j', ?, 'running', ?, ?)",
                    (spec, now, now),
                ).lastrowid
                attempt = store.connection.execute(
                    "INSERT INTO attempts(job_id, number, state, nodes, master_addr, "
                    "master_port, created_at) VALUES(?, 1, 'running', ?, 'x', 1, ?)",
                    (job, json.dumps([f"n{i}" for i in range(n)]), now),
                ).lastrowid
                assert attempt is not None
                live[attempt] = (team, n, now)
            for attempt in [a for a in live if rng.random() < 0.3]:  # some end
                team, n, start = live.pop(attempt)
                end = now - rng.uniform(0, 5)  # ended a moment ago, as reported
                store.connection.execute(
                    "UPDATE attempts SET ended_at = ?, state = 'succeeded' WHERE id = ?",
                    (max(end, start), attempt),
                )
                done.append(UsageInterval(team, n, start, max(end, start)))
        got = book.usage(now)
        want = decayed_usage(
            [*done, *(UsageInterval(t, n, s, None) for t, n, s in live.values())], now, 300.0
        )
        assert set(got) == set(want)
        for team in want:
            assert got[team] == pytest.approx(want[team], rel=1e-9, abs=1e-9)
        now += rng.uniform(1, 120)
    store.close()
