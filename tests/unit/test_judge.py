"""Attempt verdicts: a pure function from rank states to the attempt's next state."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from trainpod.controller.judge import (
    CAUSE_CANCEL,
    CAUSE_NODE_LOST,
    CAUSE_RANK_FAILED,
    Verdict,
    describe_failure,
    first_failure,
    judge,
)
from trainpod.model.failures import Failure
from trainpod.model.states import AttemptState, RankState
from trainpod.store.rows import AttemptRow, RankRow

A, R = AttemptState, RankState


def attempt(state: AttemptState = A.RUNNING, cause: str = "", **kw: Any) -> AttemptRow:
    return AttemptRow(
        id=1,
        job_id=1,
        number=1,
        state=state,
        nodes=["n-0", "n-1"],
        master_addr="127.0.0.1",
        master_port=29500,
        created_at=0.0,
        started_at=None,
        ended_at=None,
        cause=cause,
        **kw,
    )


def rank(
    rank: int,
    state: RankState = R.RUNNING,
    *,
    code: int | None = None,
    signal: int | None = None,
    ended_at: float | None = None,
) -> RankRow:
    if state.ended and ended_at is None:
        ended_at = 10.0 + rank
    return RankRow(
        attempt_id=1,
        rank=rank,
        node=f"n-{rank // 2}",
        local_rank=rank % 2,
        state=state,
        pid=None if state is R.PENDING else 100 + rank,
        exit_code=code,
        signal=signal,
        started_at=None if state is R.PENDING else 1.0,
        ended_at=ended_at,
    )


def running(n: int = 4) -> list[RankRow]:
    return [rank(i) for i in range(n)]


def exited(
    i: int, code: int = 0, *, signal: int | None = None, ended_at: float | None = None
) -> RankRow:
    """Rank ``i`` ended with ``code``, or by ``signal`` (then without a code, as reported)."""
    code_or_none = None if signal is not None else code
    return rank(i, R.EXITED, code=code_or_none, signal=signal, ended_at=ended_at)


def judged(a: AttemptRow, ranks: list[RankRow], **kw: Any) -> Verdict | None:
    kw.setdefault("cancel_requested", False)
    return judge(a, ranks, **kw)


# -- normal life ---------------------------------------------------------------------------
def test_launching_stays_until_every_rank_runs() -> None:
    ranks = [rank(0), rank(1), rank(2, R.PENDING), rank(3, R.PENDING)]
    assert judged(attempt(A.LAUNCHING), ranks) is None


def test_launching_becomes_running_once_no_rank_is_pending() -> None:
    assert judged(attempt(A.LAUNCHING), running()) == Verdict(A.RUNNING)
    # a rank that already exited 0 counts as started
    ranks = [exited(0), rank(1), rank(2), rank(3)]
    assert judged(attempt(A.LAUNCHING), ranks) == Verdict(A.RUNNING)


def test_running_with_live_ranks_stays() -> None:
    assert judged(attempt(A.RUNNING), running()) is None
    assert judged(attempt(A.RUNNING), [exited(0), exited(1), rank(2), rank(3)]) is None


@pytest.mark.parametrize("state", [A.LAUNCHING, A.RUNNING])
def test_all_ranks_exit_zero_succeeds(state: AttemptState) -> None:
    assert judged(attempt(state), [exited(i) for i in range(4)]) == Verdict(A.SUCCEEDED)


@pytest.mark.parametrize("state", [A.SUCCEEDED, A.FAILED, A.CANCELLED])
def test_an_ended_attempt_never_changes(state: AttemptState) -> None:
    ranks = [exited(0, code=1), rank(1, R.LOST), rank(2), rank(3, R.PENDING)]
    assert judged(attempt(state), ranks, cancel_requested=True) is None


# -- failures ------------------------------------------------------------------------------
def test_one_nonzero_exit_stops_the_attempt_with_a_failure_record() -> None:
    ranks = [rank(0), rank(1), exited(2, code=3), rank(3)]
    v = judged(attempt(A.RUNNING), ranks, tails={2: "Traceback\nValueError: boom"})
    assert v is not None
    assert v.state is A.STOPPING
    assert v.cause == CAUSE_RANK_FAILED
    assert v.failure.to_json() == {
        "rank": 2,
        "node": "n-1",
        "exit_code": 3,
        "signal": None,
        "lost": False,
        "log_tail": "Traceback\nValueError: boom",
    }


def test_stopping_waits_for_every_rank_then_fails_with_the_first_failure() -> None:
    failure = Failure.from_json(
        {"rank": 2, "node": "n-1", "exit_code": 3, "signal": None, "lost": False}
        | {"log_tail": "ValueError: boom"}
    )
    stopping = attempt(A.STOPPING, CAUSE_RANK_FAILED, failure=failure)
    partly = [rank(0), exited(1, signal=15), exited(2, code=3), rank(3)]
    assert judged(stopping, partly) is None
    ended = [exited(0, signal=15), exited(1, signal=15), exited(2, code=3), exited(3, signal=15)]
    # the record made when the attempt started stopping wins over later (teardown) exits
    assert judged(stopping, ended, tails={0: "Terminated"}) == Verdict(
        A.FAILED, CAUSE_RANK_FAILED, failure
    )


def test_a_failure_with_every_rank_ended_fails_at_once() -> None:
    ranks = [exited(0), exited(1), exited(2, code=1), exited(3)]
    v = judged(attempt(A.RUNNING), ranks)
    assert v is not None
    assert (v.state, v.cause, v.failure.rank) == (A.FAILED, CAUSE_RANK_FAILED, 2)
    assert v.failure.log_tail == ""


def test_a_rank_killed_by_a_signal_is_a_failure() -> None:
    ranks = [rank(0), exited(1, signal=9), rank(2), rank(3)]
    v = judged(attempt(A.RUNNING), ranks)
    assert v is not None
    assert (v.state, v.cause) == (A.STOPPING, CAUSE_RANK_FAILED)
    assert (v.failure.signal, v.failure.exit_code, v.failure.lost) == (9, None, False)


def test_a_lost_rank_means_its_node_was_lost() -> None:
    ranks = [rank(0, R.LOST), rank(1, R.LOST), rank(2), rank(3)]
    v = judged(attempt(A.RUNNING), ranks)
    assert v is not None
    assert (v.state, v.cause) == (A.STOPPING, CAUSE_NODE_LOST)
    assert (v.failure.rank, v.failure.node, v.failure.lost) == (0, "n-0", True)
    all_lost = [rank(i, R.LOST) for i in range(4)]
    v = judged(attempt(A.RUNNING), all_lost)
    assert v is not None
    assert (v.state, v.cause) == (A.FAILED, CAUSE_NODE_LOST)


def test_the_earliest_failure_is_the_one_recorded() -> None:
    ranks = [
        exited(0, code=1, ended_at=20.0),
        exited(1, signal=15, ended_at=30.0),
        exited(2, code=3, ended_at=5.0),
        exited(3, code=2, ended_at=5.0),
    ]
    failure = first_failure(ranks, {})
    assert failure is not None
    assert failure.rank == 2  # earliest; ties go to the lower rank
    assert first_failure([exited(0), rank(1)], {}) is None


def test_a_failure_while_launching_stops_the_attempt() -> None:
    ranks = [exited(0, code=127), rank(1), rank(2), rank(3)]
    v = judged(attempt(A.LAUNCHING), ranks)
    assert v is not None
    assert (v.state, v.cause) == (A.STOPPING, CAUSE_RANK_FAILED)


def test_ranks_that_never_started_need_no_teardown() -> None:
    """A failure while other nodes have not started their ranks yet: those will never be
    launched (their node gets a kill order instead), so they must not hold the attempt."""
    ranks = [exited(0, code=127), exited(1), rank(2, R.PENDING), rank(3, R.PENDING)]
    v = judged(attempt(A.LAUNCHING), ranks)
    assert v is not None
    assert (v.state, v.cause, v.failure.rank) == (A.FAILED, CAUSE_RANK_FAILED, 0)
    stopping = attempt(A.STOPPING, CAUSE_RANK_FAILED, failure=v.failure)
    assert judged(stopping, [rank(0), *ranks[1:]]) is None  # rank 0 still running
    assert judged(stopping, ranks) == Verdict(A.FAILED, CAUSE_RANK_FAILED, v.failure)


# -- cancel --------------------------------------------------------------------------------
def test_cancel_while_running_stops_then_cancels() -> None:
    v = judged(attempt(A.RUNNING), running(), cancel_requested=True)
    assert v == Verdict(A.STOPPING, CAUSE_CANCEL)
    stopping = attempt(A.STOPPING, CAUSE_CANCEL)
    partly = [exited(0, signal=15), rank(1), rank(2), rank(3)]
    assert judged(stopping, partly, cancel_requested=True) is None
    ended = [exited(i, signal=15) for i in range(4)]
    assert judged(stopping, ended, cancel_requested=True) == Verdict(A.CANCELLED, CAUSE_CANCEL)


def test_cancel_while_launching_with_some_ranks_started_stops() -> None:
    ranks = [rank(0), rank(1), rank(2, R.PENDING), rank(3, R.PENDING)]
    v = judged(attempt(A.LAUNCHING), ranks, cancel_requested=True)
    assert v == Verdict(A.STOPPING, CAUSE_CANCEL)


def test_cancel_before_any_rank_started_cancels_at_once() -> None:
    ranks = [rank(i, R.PENDING) for i in range(4)]
    v = judged(attempt(A.LAUNCHING), ranks, cancel_requested=True)
    assert v == Verdict(A.CANCELLED, CAUSE_CANCEL)
    stopping = attempt(A.STOPPING, CAUSE_CANCEL)
    assert judged(stopping, ranks, cancel_requested=True) == Verdict(A.CANCELLED, CAUSE_CANCEL)


def test_cancel_with_every_rank_ended_cancels_at_once() -> None:
    ranks = [exited(i) for i in range(4)]
    v = judged(attempt(A.RUNNING), ranks, cancel_requested=True)
    assert v == Verdict(A.CANCELLED, CAUSE_CANCEL)


def test_cancel_wins_over_a_failure_seen_at_the_same_time() -> None:
    ranks = [exited(0, code=1), rank(1), rank(2), rank(3)]
    assert judged(attempt(A.RUNNING), ranks, cancel_requested=True) == Verdict(
        A.STOPPING, CAUSE_CANCEL
    )


def test_a_failure_already_stopping_the_attempt_is_not_turned_into_a_cancel() -> None:
    failure = Failure.from_json(
        {"rank": 0, "node": "n-0", "exit_code": 1, "signal": None, "lost": False}
    )
    stopping = attempt(A.STOPPING, CAUSE_RANK_FAILED, failure=failure)
    ranks = [exited(0, code=1), *(exited(i, signal=15) for i in range(1, 4))]
    v = judged(stopping, ranks, cancel_requested=True)
    assert v == Verdict(A.FAILED, CAUSE_RANK_FAILED, failure)


# -- describing failures -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("failure", "text"),
    [
        ({}, ""),
        (
            {"rank": 2, "node": "n-1", "exit_code": 3, "signal": None, "lost": False},
            "rank 2 on n-1 exited with code 3",
        ),
        (
            {"rank": 0, "node": "n-0", "exit_code": None, "signal": 9, "lost": False},
            "rank 0 on n-0 was killed by signal 9",
        ),
        (
            {"rank": 1, "node": "n-0", "exit_code": None, "signal": None, "lost": True},
            "rank 1 on n-0 was lost with its node",
        ),
    ],
)
def test_describe_failure(failure: dict[str, Any], text: str) -> None:
    assert describe_failure(Failure.from_json(failure)) == text


def test_judge_does_not_mutate_its_inputs() -> None:
    a = attempt(A.RUNNING)
    ranks = [rank(0), exited(1, code=2), rank(2), rank(3)]
    before = (replace(a), [replace(r) for r in ranks])
    judged(a, ranks, tails={1: "x"})
    assert (a, ranks) == before


# -- a rank that aborted in its interpreter's teardown (pytorch/pytorch#179291, ADR 0044) ----
ABORT = 6


def test_a_teardown_abort_after_every_other_rank_exited_0_is_a_success() -> None:
    ranks = [exited(0, signal=ABORT), exited(1), exited(2), exited(3)]
    v = judged(attempt(), ranks, teardown=frozenset({0}), now=20.0)
    assert v is not None and v.state is A.SUCCEEDED and v.failure.empty
    assert "rank 0 aborted (SIGABRT) in its interpreter's teardown" in v.note
    assert "pytorch/pytorch#179291" in v.note


def test_a_teardown_abort_waits_for_the_running_ranks_then_succeeds_with_them() -> None:
    first = [exited(0, signal=ABORT, ended_at=10.0), rank(1), rank(2), rank(3)]
    assert judged(attempt(), first, teardown=frozenset({0}), now=12.0) is None
    later = [first[0], exited(1), exited(2), exited(3)]
    v = judged(attempt(), later, teardown=frozenset({0}), now=13.0)
    assert v is not None and v.state is A.SUCCEEDED


def test_a_teardown_abort_whose_peers_do_not_end_in_time_is_the_failure_it_looks_like() -> None:
    ranks = [exited(0, signal=ABORT, ended_at=10.0), rank(1), rank(2), rank(3)]
    v = judged(attempt(), ranks, teardown=frozenset({0}), now=40.0, teardown_abort_wait_s=30.0)
    assert v is not None and v.state is A.STOPPING and v.cause == CAUSE_RANK_FAILED
    assert v.failure.rank == 0 and v.failure.signal == ABORT


def test_a_teardown_abort_with_a_peer_that_failed_is_a_failure() -> None:
    ranks = [exited(0, signal=ABORT, ended_at=10.0), exited(1, 1, ended_at=11.0), exited(2)]
    v = judged(attempt(), [*ranks, exited(3)], teardown=frozenset({0}), now=12.0)
    assert v is not None and v.state is A.FAILED and v.failure.rank == 0


def test_a_lone_rank_s_teardown_abort_has_no_peer_to_vouch_for_it() -> None:
    v = judged(attempt(), [exited(0, signal=ABORT)], teardown=frozenset({0}), now=20.0)
    assert v is not None and v.state is A.FAILED and v.failure.signal == ABORT


def test_a_sigabrt_not_judged_a_teardown_abort_fails_at_once() -> None:
    ranks = [exited(0, signal=ABORT, ended_at=10.0), rank(1)]
    v = judged(attempt(), ranks, now=10.5)
    assert v is not None and v.state is A.STOPPING


def test_a_cancel_is_not_held_by_a_teardown_abort() -> None:
    ranks = [exited(0, signal=ABORT, ended_at=10.0), rank(1)]
    v = judged(attempt(), ranks, teardown=frozenset({0}), now=10.5, cancel_requested=True)
    assert v is not None and v.state is A.STOPPING and v.cause == CAUSE_CANCEL
