"""The transition tables: what is legal, what is not, and that check() says so loudly."""

from __future__ import annotations

from typing import Any, Literal

import pytest

from trainpod.api.models import Heartbeat, LifecycleStatus
from trainpod.controller.nodes import node_state_after_heartbeat
from trainpod.model.states import (
    ATTEMPT_TRANSITIONS,
    JOB_TRANSITIONS,
    NODE_TRANSITIONS,
    AttemptState,
    IllegalTransition,
    JobState,
    NodeState,
    RankState,
    check,
)
from trainpod.store.rows import NodeRow

N, J, A = NodeState, JobState, AttemptState


def test_every_state_has_a_row() -> None:
    assert set(NODE_TRANSITIONS) == set(NodeState)
    assert set(JOB_TRANSITIONS) == set(JobState)
    assert set(ATTEMPT_TRANSITIONS) == set(AttemptState)


@pytest.mark.parametrize(
    ("table", "old", "new"),
    [
        (NODE_TRANSITIONS, N.PROVISIONING, N.SETTING_UP),
        (NODE_TRANSITIONS, N.SETTING_UP, N.IDLE),
        (NODE_TRANSITIONS, N.SETTING_UP, N.FAILED),
        (NODE_TRANSITIONS, N.IDLE, N.ALLOCATED),
        (NODE_TRANSITIONS, N.ALLOCATED, N.IDLE),
        (NODE_TRANSITIONS, N.ALLOCATED, N.SUSPECT),
        (NODE_TRANSITIONS, N.SUSPECT, N.IDLE),
        (NODE_TRANSITIONS, N.QUARANTINED, N.REPAIRING),
        (NODE_TRANSITIONS, N.REPAIRING, N.IDLE),
        (JOB_TRANSITIONS, J.QUEUED, J.STARTING),
        (JOB_TRANSITIONS, J.QUEUED, J.CANCELLED),
        (JOB_TRANSITIONS, J.STARTING, J.RUNNING),
        (JOB_TRANSITIONS, J.RUNNING, J.STOPPING),
        (JOB_TRANSITIONS, J.RUNNING, J.COMPLETED),
        (JOB_TRANSITIONS, J.STOPPING, J.FAILED),
        (JOB_TRANSITIONS, J.STOPPING, J.CANCELLED),
        (JOB_TRANSITIONS, J.PREEMPTED, J.QUEUED),
        (JOB_TRANSITIONS, J.STOPPING, J.PREEMPTED),  # its preempted attempt has ended
        (JOB_TRANSITIONS, J.PREEMPTED, J.STARTING),  # placed again, like a queued job
        (ATTEMPT_TRANSITIONS, A.LAUNCHING, A.RUNNING),
        (ATTEMPT_TRANSITIONS, A.LAUNCHING, A.CANCELLED),
        (ATTEMPT_TRANSITIONS, A.RUNNING, A.STOPPING),
        (ATTEMPT_TRANSITIONS, A.RUNNING, A.SUCCEEDED),
        (ATTEMPT_TRANSITIONS, A.STOPPING, A.FAILED),
        (ATTEMPT_TRANSITIONS, A.STOPPING, A.CANCELLED),
    ],
)
def test_legal_transitions_pass(table: dict[Any, set[Any]], old: Any, new: Any) -> None:
    check("x", table, old, new)


@pytest.mark.parametrize(
    ("kind", "table", "old", "new"),
    [
        ("node", NODE_TRANSITIONS, N.RETIRED, N.IDLE),
        ("node", NODE_TRANSITIONS, N.PROVISIONING, N.ALLOCATED),
        ("node", NODE_TRANSITIONS, N.QUARANTINED, N.ALLOCATED),
        ("job", JOB_TRANSITIONS, J.COMPLETED, J.RUNNING),
        ("job", JOB_TRANSITIONS, J.FAILED, J.QUEUED),
        ("job", JOB_TRANSITIONS, J.CANCELLED, J.STARTING),
        ("job", JOB_TRANSITIONS, J.QUEUED, J.RUNNING),
        ("job", JOB_TRANSITIONS, J.RUNNING, J.CANCELLED),
        ("attempt", ATTEMPT_TRANSITIONS, A.SUCCEEDED, A.RUNNING),
        ("attempt", ATTEMPT_TRANSITIONS, A.RUNNING, A.LAUNCHING),
        ("attempt", ATTEMPT_TRANSITIONS, A.RUNNING, A.CANCELLED),
        ("attempt", ATTEMPT_TRANSITIONS, A.STOPPING, A.RUNNING),
    ],
)
def test_illegal_transitions_raise_naming_both_states(
    kind: str,
    table: dict[Any, set[Any]],
    old: Any,
    new: Any,
) -> None:
    with pytest.raises(IllegalTransition) as err:
        check(kind, table, old, new)
    assert str(err.value) == f"{kind}: {old.value} -> {new.value} is not allowed"


@pytest.mark.parametrize("state", [*NodeState, *JobState, *AttemptState])
def test_staying_put_is_always_allowed(state: NodeState | JobState | AttemptState) -> None:
    tables: dict[type, dict[Any, set[Any]]] = {
        NodeState: NODE_TRANSITIONS,
        JobState: JOB_TRANSITIONS,
        AttemptState: ATTEMPT_TRANSITIONS,
    }
    check("x", tables[type(state)], state, state)


def test_ended_states_are_terminal() -> None:
    for job_state in JobState:
        if job_state.ended:
            assert JOB_TRANSITIONS[job_state] == set()
    for attempt_state in AttemptState:
        if attempt_state.ended:
            assert ATTEMPT_TRANSITIONS[attempt_state] == set()
    assert {s for s in JobState if s.ended} == {J.COMPLETED, J.FAILED, J.CANCELLED}
    assert {s for s in AttemptState if s.ended} == {A.SUCCEEDED, A.FAILED, A.CANCELLED}
    assert {s for s in RankState if s.ended} == {RankState.EXITED, RankState.LOST}
    assert NODE_TRANSITIONS[N.RETIRED] == {N.REPAIRING}  # only an operator brings it back


def test_every_state_is_reachable_from_the_start() -> None:
    cases: list[tuple[dict[Any, set[Any]], Any, set[Any]]] = [
        (NODE_TRANSITIONS, N.PROVISIONING, set()),
        (JOB_TRANSITIONS, J.QUEUED, set()),
        (ATTEMPT_TRANSITIONS, A.LAUNCHING, set()),
    ]
    for table, start, unused in cases:
        seen, todo = {start}, [start]
        while todo:
            for nxt in table[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert seen == set(table) - unused, set(table) - seen


def _node(state: NodeState, job_id: int | None) -> NodeRow:
    return NodeRow(
        name="workers-0",
        group="workers",
        role="compute",
        spare=False,
        devices=2,
        state=state,
        reason="",
        job_id=job_id,
        address="127.0.0.1",
        agent_id="a",
        agent_pid=1,
        last_heartbeat=0.0,
        facts_json="{}",
        updated_at=0.0,
    )


# The (state, job) pairs a node can be in: a node holds its job from allocation until the
# job's attempt has ended, whatever it goes through meanwhile.
_HOLDS_A_JOB = {N.ALLOCATED, N.SUSPECT, N.SETTING_UP, N.FAILED, N.STOPPED}
_HOLDS_A_JOB |= {N.QUARANTINED, N.REPAIRING}
_NODE_CASES: list[tuple[NodeState, int | None]] = [
    (s, None) for s in NodeState if s is not N.ALLOCATED
]
_NODE_CASES += [(s, 7) for s in NodeState if s in _HOLDS_A_JOB]


@pytest.mark.parametrize(("state", "job_id"), _NODE_CASES)
@pytest.mark.parametrize("lifecycle", ["running", "ok", "failed"])
@pytest.mark.parametrize("leaving", [False, True])
def test_whatever_an_agent_reports_moves_its_node_legally(
    state: NodeState,
    job_id: int | None,
    lifecycle: Literal["running", "ok", "failed"],
    leaving: bool,
) -> None:
    """Any heartbeat from any agent (a restarted one included) is a legal node transition.

    An agent that restarts reports ``lifecycle: running`` until its scripts (or the marker
    of an earlier run) say otherwise, and a script can fail before the first beat.
    """
    hb = Heartbeat(
        node="workers-0",
        agent_id="b",
        agent_pid=2,
        address="127.0.0.1",
        lifecycle=LifecycleStatus(state=lifecycle),
        leaving=leaving,
    )
    target, _ = node_state_after_heartbeat(_node(state, job_id), hb)
    if target is not None:
        check("node", NODE_TRANSITIONS, state, target)
    if state in (N.QUARANTINED, N.REPAIRING, N.RETIRED):
        assert target is None  # only the recovery engine or an operator moves these
    elif leaving:
        assert target is N.STOPPED
    elif lifecycle == "ok":
        assert target is (N.IDLE if job_id is None else N.ALLOCATED)


def test_states_print_as_their_values() -> None:
    assert (str(JobState.RUNNING), f"{NodeState.IDLE:>6}") == ("running", "  idle")
    assert f"{AttemptState.FAILED}" == "failed" and JobState("failed") is JobState.FAILED
    failed: str = "failed"  # as the API and old rows have it
    assert failed == JobState.FAILED and JobState.FAILED in {failed}
