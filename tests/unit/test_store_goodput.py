"""Ended jobs' goodput kept in the store (migration 11), and the aggregate reads /metrics
makes instead of keeping anything per job: job counts by label, energy by team."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from trainpod.model.states import JobState
from trainpod.store.db import open_db
from trainpod.store.energy import IDLE_JOB, Energy, EnergyRow, EnergyTotal
from trainpod.store.goodput import EndedGoodput, EndedGoodputRow, TeamGoodput
from trainpod.store.repo import Store
from trainpod.store.scan import job_counts, recently_ended


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(open_db(tmp_path / "state.db"))
    yield s
    s.close()


def job(store: Store, state: JobState, ended_at: float | None = None, **spec: str) -> int:
    with store.transaction():
        j = store.insert_job("j", {"command": ["x"], **spec}, 1.0)
        store.update_job(j, 2.0, state=state, ended_at=ended_at)
    return j


def test_a_team_s_sums_are_its_jobs_and_a_job_is_kept_once(store: Store) -> None:
    kept = EndedGoodput(store)
    rows = [
        EndedGoodputRow(1, "vision", 10.0, 8.0, {"restart": 1.5, "checkpoint": 0.5}),
        EndedGoodputRow(2, "vision", 4.0, 4.0),
        EndedGoodputRow(3, "speech", 6.0, 3.0, {"restart": 3.0}),
    ]
    with store.transaction():
        assert kept.record(rows) == [1, 2, 3]
    with store.transaction():  # kept again (a second collector, a retry): left as it was
        assert kept.record([EndedGoodputRow(1, "vision", 99.0, 0.0, {"restart": 99.0})]) == []
    assert kept.by_team() == {
        "vision": TeamGoodput(14.0, 12.0, {"restart": 1.5, "checkpoint": 0.5}),
        "speech": TeamGoodput(6.0, 3.0, {"restart": 3.0}),
    }


def test_uncounted_are_the_ended_jobs_not_kept_in_the_window_asked(store: Store) -> None:
    done = job(store, JobState.COMPLETED, ended_at=100.0)
    failed = job(store, JobState.FAILED, ended_at=200.0)
    late = job(store, JobState.CANCELLED, ended_at=300.0)
    job(store, JobState.RUNNING)
    job(store, JobState.COMPLETED)  # ended without a time: never counted
    kept = EndedGoodput(store)
    assert kept.uncounted(ended_by=250.0) == [done, failed]
    assert kept.uncounted(ended_by=400.0, ended_after=150.0) == [failed, late]
    assert kept.uncounted(ended_by=400.0, above_id=done) == [failed, late]
    assert kept.uncounted(ended_by=400.0, limit=1) == [done]
    with store.transaction():
        kept.record([EndedGoodputRow(failed, "none", 1.0, 1.0)])
    assert kept.uncounted(ended_by=400.0) == [done, late]
    assert kept.count_uncounted(ended_by=400.0) == 2
    assert kept.count_uncounted(ended_by=400.0, ended_after=200.0) == 1
    assert recently_ended(store, 150.0) == [failed, late]


def test_job_counts_group_by_state_and_the_spec_s_labels(store: Store) -> None:
    for team in ("vision", "vision", "speech"):
        job(store, JobState.QUEUED, team=team, priority_class="high")
    job(store, JobState.COMPLETED, ended_at=5.0, team="vision", partition="gpu")
    job(store, JobState.RUNNING)
    assert sorted(job_counts(store), key=str) == sorted(
        [
            (JobState.QUEUED, "vision", "high", None, 2),
            (JobState.QUEUED, "speech", "high", None, 1),
            (JobState.COMPLETED, "vision", None, "gpu", 1),
            (JobState.RUNNING, None, None, None, 1),
        ],
        key=str,
    )


def test_energy_by_team_by_job_and_in_all(store: Store) -> None:
    vision = job(store, JobState.RUNNING, team="vision")
    plain = job(store, JobState.RUNNING)
    energy = Energy(store)
    with store.transaction():
        energy.add(
            [
                EnergyRow(vision, 1, "n0", 10.0, False),
                EnergyRow(vision, 2, "n1", 5.0, True),
                EnergyRow(plain, 1, "n0", 2.0, False),
                EnergyRow(IDLE_JOB, 0, "n2", 1.0, False),
                EnergyRow(999, 1, "n0", 4.0, False),  # its job is no longer in the store
            ],
            3.0,
        )
    assert energy.per_team() == {
        "vision": EnergyTotal(15.0, True),
        None: EnergyTotal(2.0, False),
        "unknown": EnergyTotal(4.0, False),
    }
    assert energy.of_jobs([vision, 12345]) == {vision: EnergyTotal(15.0, True)}
    assert energy.total() == EnergyTotal(22.0, True)
