"""The failure record and the repair state round-trip their JSON columns exactly: old rows
load, and are written back as they were read."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from trainpod.controller.judge import first_failure
from trainpod.model.failures import Classified, Failure, RepairState
from trainpod.model.states import RankState
from trainpod.store.rows import RankRow

# Rows as the controller wrote them before these were dataclasses (keys sorted, as stored).
OLD_FAILURES: list[dict[str, Any]] = [
    {},
    # judge.first_failure, then _note_fault, then _recover
    {"exit_code": 3, "lost": False, "log_tail": "boom", "node": "n-1", "rank": 2, "signal": None},
    {"exit_code": None, "lost": False, "log_tail": "", "node": "n-0", "rank": 0, "signal": 9},
    {
        "classified": {"kind": "crash", "nodes": ["n-1"], "reason": "r", "signature": "3|boom"},
        "exit_code": 3,
        "fault_at": 12.5,
        "log_tail": "boom",
        "lost": False,
        "node": "n-1",
        "noted": True,
        "rank": 2,
        "signal": None,
    },
    # the watchdog's hang, with and without a rank
    {"fault_at": 5.0, "node": "n-0", "nodes": ["n-0"], "rank": 1, "reason": "no beacon"},
    {"fault_at": 5.0, "node": None, "nodes": [], "rank": None, "reason": "startup timeout"},
    # a quarantine, a preemption (grace as an int stays an int)
    {"fault_at": 7.0, "node": "n-2", "nodes": ["n-2"], "reason": "n-2: XID 79"},
    {"grace_s": 30, "nodes": ["n-0", "n-1"], "reason": "preempted by job 4"},
    {"grace_s": 2.5, "nodes": [], "reason": "quota"},
]

OLD_REPAIRS: list[dict[str, Any]] = [
    {},
    {"kind": "gpu_fault", "requested": True, "since": 3.0},
    {"kind": "quarantined", "requested": False, "since": 3.0},
    {"kind": "gpu_fault", "mode": "replace", "old_agent": "agent-1", "started_at": 4.0},
    {"kind": "", "mode": "check", "old_agent": None, "started_at": 4.0},
    {
        "deep_check_id": "abc123def456",
        "kind": "gpu_fault",
        "mode": "check",
        "old_agent": None,
        "started_at": 4.0,
    },
]


def stored(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True)  # how the store writes a JSON column


@pytest.mark.parametrize("row", OLD_FAILURES)
def test_an_old_failure_row_is_written_back_as_read(row: dict[str, Any]) -> None:
    failure = Failure.from_json(json.loads(stored(row)))
    assert failure.to_json() == row
    assert stored(failure.to_json()) == stored(row)
    assert list(failure.to_json()) == sorted(row)  # the API shows the keys in this order
    assert Failure.from_json(failure.to_json()) == failure
    assert failure.empty is (row == {})


@pytest.mark.parametrize("row", OLD_REPAIRS)
def test_an_old_repair_row_is_written_back_as_read(row: dict[str, Any]) -> None:
    repair = RepairState.from_json(json.loads(stored(row)))
    assert repair.to_json() == row
    assert RepairState.from_json(repair.to_json()) == repair
    assert repair.empty is (row == {})


def test_fields_read_from_an_old_row() -> None:
    f = Failure.from_json(OLD_FAILURES[3])
    assert (f.rank, f.node, f.exit_code, f.signal, f.lost) == (2, "n-1", 3, None, False)
    assert (f.noted, f.fault_at, f.nodes) == (True, 12.5, None)
    assert f.classified == Classified("crash", "r", ("n-1",), "3|boom")
    hang = Failure.from_json(OLD_FAILURES[5])
    assert (hang.rank, hang.node, hang.nodes) == (None, None, ())
    r = RepairState.from_json(OLD_REPAIRS[5])
    assert (r.mode, r.old_agent, r.deep_check_id, r.requested) == (
        "check",
        None,
        "abc123def456",
        None,
    )
    assert RepairState() == RepairState.from_json({})
    assert not RepairState().requested and RepairState().mode is None


def test_missing_keys_get_defaults_and_unknown_keys_are_kept() -> None:
    row = {"rank": 3, "from_a_newer_version": {"x": [1]}, "classified": {"kind": "hang"}}
    f = Failure.from_json(row)
    assert (f.rank, f.reason, f.nodes, f.noted) == (3, None, None, None)
    assert f.classified == Classified("hang")
    assert f.to_json()["from_a_newer_version"] == {"x": [1]}
    noted = replace(f, noted=True, fault_at=1.0)
    assert noted.to_json()["from_a_newer_version"] == {"x": [1]}
    assert noted.to_json()["classified"] == {
        "kind": "hang",
        "nodes": [],
        "reason": "",
        "signature": "",
    }
    assert Failure.from_json({"classified": {}}).to_json() == {"classified": {}}
    assert RepairState.from_json({"kind": "x", "later": 1}).to_json() == {"kind": "x", "later": 1}


def test_replace_adds_keys_like_the_dict_updates_did() -> None:
    hang = Failure.from_json(OLD_FAILURES[5])
    noted = replace(hang, noted=True)
    assert noted.to_json() == {**OLD_FAILURES[5], "noted": True}
    classified = replace(noted, classified=Classified("hang", "startup timeout"))
    assert classified.to_json()["classified"]["kind"] == "hang"
    assert replace(RepairState(mode="check"), deep_check_id="x").to_json() == {
        "deep_check_id": "x",
        "mode": "check",
    }


def test_a_rank_failure_writes_every_key_null_or_not() -> None:
    rank = RankRow(
        attempt_id=1,
        rank=0,
        node="n-0",
        local_rank=0,
        state=RankState.EXITED,
        pid=10,
        exit_code=None,
        signal=9,
        started_at=1.0,
        ended_at=2.0,
    )
    failure = first_failure([rank], {})
    assert failure is not None
    assert failure.to_json() == OLD_FAILURES[2]
    assert failure == Failure.from_json(OLD_FAILURES[2])  # equal once stored and read back
