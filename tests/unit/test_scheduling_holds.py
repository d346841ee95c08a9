"""The scheduling benchmark's "nodes held" utilisation: holds read from a real trainpod store
and from Slurm's own log lines, and the figure computed from them."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest
from benchmarks.schedulingholds import Hold, holds_of, slurm_holds, trainpod_holds
from benchmarks.schedulingkit import (
    PARAMS,
    JobOutcome,
    TraceJob,
    held_waiting_intervals,
    parse_log,
    replay_metrics,
)

from trainpod.model.events import AttemptCreated, NodeReleased
from trainpod.store.repo import Store


def _job(index: int, nodes: int = 1) -> TraceJob:
    return TraceJob(index, 0.0, "vision", "vision-user", "low", nodes, 10, "0:20")


def _created(job: int, nodes: tuple[str, ...]) -> AttemptCreated:
    return AttemptCreated(
        job_id=job, attempt=1, attempt_id=None, nodes=nodes, master_addr=None, master_port=None
    )


def test_trainpod_holds_from_the_event_log(tmp_path: Path) -> None:
    db = tmp_path / "controller.db"
    store = Store.open(db)
    with store.transaction():
        a = store.insert_job("trace0", {}, 1.0)
        b = store.insert_job("trace1", {}, 1.0)
        store.insert_job("other", {}, 1.0)  # not the trace's: ignored
        store.append(2.0, _created(a, ("n1", "n2")))
        store.append(5.0, NodeReleased(node="n1", job_id=a))
        store.append(5.5, NodeReleased(node="n2", job_id=a))
        store.append(5.5, _created(b, ("n1",)))
    store.close()
    got = sorted(trainpod_holds(db), key=lambda h: (h.index, h.node))
    assert got == [
        Hold(0, "n1", 2.0, 5.0),
        Hold(0, "n2", 2.0, 5.5),
        Hold(1, "n1", 5.5, None),  # still held when the log was copied
    ]
    assert holds_of(tmp_path) == trainpod_holds(db)


def _t(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def test_slurm_holds_from_slurmctlds_log(tmp_path: Path) -> None:
    (tmp_path / "slurm" / "log").mkdir(parents=True)
    (tmp_path / "slurmctld.log").write_text(
        "[2026-12-01T13:08:47.550] sched/backfill: _start_job: Started JobId=13 in low on node3\n"
        "[2026-12-01T13:08:53.556] preempted JobId=13 has been requeued to reclaim resources\n"
        "[2026-12-01T13:08:53.741] Requeuing JobId=13\n"
        "[2026-12-01T13:08:53.742] sched: Allocate JobId=23 NodeList=node[3-4] #CPUs=2 "
        "Partition=normal\n"
        "[2026-12-01T13:08:57.632] _job_complete: JobId=23 WEXITSTATUS 0\n"
        "[2026-12-01T13:08:57.632] _job_complete: JobId=23 done\n"
        "[2026-12-01T13:09:03.768] sched: Allocate JobId=13 NodeList=node3 #CPUs=1 "
        "Partition=low\n"
        "[2026-12-01T13:09:04.000] sched: Allocate JobId=99 NodeList=node1 #CPUs=1\n"
    )
    (tmp_path / "slurm" / "log" / "jobcomp.log").write_text(
        "JobId=13 UserId=root(0) GroupId=root(0) Name=trace12 JobState=PREEMPTED\n"
        "JobId=23 UserId=root(0) GroupId=root(0) Name=trace22 JobState=COMPLETED\n"
    )
    got = holds_of(tmp_path)
    assert got is not None
    assert sorted(got, key=lambda h: (h.start, h.node)) == [
        Hold(12, "node3", _t("2026-12-01T13:08:47.550"), _t("2026-12-01T13:08:53.741")),
        Hold(22, "node3", _t("2026-12-01T13:08:53.742"), _t("2026-12-01T13:08:57.632")),
        Hold(22, "node4", _t("2026-12-01T13:08:53.742"), _t("2026-12-01T13:08:57.632")),
        Hold(12, "node3", _t("2026-12-01T13:09:03.768"), None),
    ]
    assert got == slurm_holds(tmp_path / "slurmctld.log", tmp_path / "slurm/log/jobcomp.log")
    assert holds_of(tmp_path / "slurm") is None  # no records there


LOG = """\
kind=start t=100.5 step=0 nodes=n1
kind=step t=101.0 step=1 nodes=n1
kind=done t=104.0 step=1 nodes=n1
"""


def test_held_counts_the_jobs_own_start_up_and_exit_as_busy() -> None:
    params = replace(PARAMS, nodes=1, teams=("vision",))
    first = JobOutcome(_job(0), 99.0, parse_log(LOG.splitlines()))
    # Held 100.0-104.2 (placed before its first line, released after its last); the second
    # job waits from 99.5 and is given the node at 104.3 (then the replay ends at 104.3).
    second = JobOutcome(_job(1), 99.5, [])
    holds = [Hold(0, "n1", 100.0, 104.2), Hold(1, "n1", 104.3, None)]
    assert held_waiting_intervals([first, second], holds, 104.3) == [
        (99.0, 100.0, 1.0),
        (99.5, 104.3, 1.0),
    ]
    m = replay_metrics([first, second], params, end_t=104.3, holds=holds)
    # while work waits (99.0-104.3): held 100.0-104.2 -> 4.2 of 5.3 s
    assert m["utilisation_held_while_waiting"] == pytest.approx(4.2 / 5.3)
    # from the workers' lines: busy 100.5-104.0, with the second one waiting until the end
    assert m["utilisation_while_waiting"] == pytest.approx(3.5 / 5.3)
    unknown = replay_metrics([first, second], params, end_t=104.3)
    held = unknown["utilisation_held_while_waiting"]  # no records: NaN
    assert isinstance(held, float) and math.isnan(held)
