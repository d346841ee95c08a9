"""The in-process rung's call on a hung attempt (:func:`trainpod.controller.rung.decide_hang`).

Two nodes of two ranks; rank 3 stops (alive, silent). The others say they lost their group
once their collective timeout runs out (``lost_generation`` in their beacons); until then
the rung waits, then it replaces exactly the ranks that stayed silent.
"""

from __future__ import annotations

from dataclasses import replace

from trainpod.api.models import RankBeacon
from trainpod.controller import progress
from trainpod.controller.rung import (
    HANG_GRACE_S,
    FallBack,
    RecoverInProcess,
    WaitForPeers,
    decide_hang,
)
from trainpod.model.recovery import InProcess
from trainpod.model.states import AttemptState, RankState
from trainpod.store.rows import AttemptRow, RankRow

NOW = 1000.0
FAULT_AT = 990.0  # the job stopped progressing 10 s ago
REASON = "rank 3 sent no progress beacon for 10.0s"
NODES = frozenset({"a", "b"})


def attempt(generation: int = 0) -> AttemptRow:
    return AttemptRow(
        id=1,
        job_id=1,
        number=1,
        state=AttemptState.RUNNING,
        nodes=["a", "b"],
        master_addr="127.0.0.1",
        master_port=29500,
        created_at=0.0,
        started_at=1.0,
        ended_at=None,
        cause="",
        in_process=InProcess(generation=generation),
    )


def ranks() -> list[RankRow]:
    return [
        RankRow(
            1, r, "a" if r < 2 else "b", r % 2, RankState.RUNNING, 100 + r, None, None, 1.0, None
        )
        for r in range(4)
    ]


def beacon(
    rank: int, *, age: float, lost: int | None = None, timeout: float | None = 2.0
) -> tuple[RankBeacon, float]:
    b = RankBeacon(
        rank=rank,
        first_at=0.0,
        last_at=0.0,
        age_s=age,
        lost_generation=lost,
        collective_timeout_s=timeout,
    )
    return (b, NOW)  # received now: its age is its age at the agent


def decide(book: dict[int, tuple[RankBeacon, float]], **kw: object) -> object:
    args: dict[str, object] = {
        "attempt": attempt(),
        "ranks": ranks(),
        "beacons": book,
        "hung_rank": 3,
        "reason": REASON,
        "fault_at": FAULT_AT,
        "now": NOW,
        "healthy_nodes": NODES,
        "restarts_left": 3,
        "settle_s": 1.5,
    }
    args.update(kw)
    return decide_hang(**args)  # type: ignore[arg-type]


def test_the_silent_rank_alone_is_replaced_once_the_others_lost_their_group() -> None:
    book = {r: beacon(r, age=2.0, lost=0) for r in (0, 1, 2)} | {3: beacon(3, age=10.0)}
    d = decide(book)
    assert isinstance(d, RecoverInProcess)
    assert (d.generation, d.rank, d.replaced, d.fault_at) == (1, 3, (3,), FAULT_AT)
    assert "rank 3 stayed silent while the others lost their group" in d.reason
    assert d.reason.startswith(REASON)


def test_it_waits_for_the_collective_timeout_and_then_falls_back() -> None:
    book = {r: beacon(r, age=10.0, timeout=5.0) for r in range(4)}
    early = decide(book, fault_at=NOW - 5.0 - HANG_GRACE_S + 0.1)
    assert isinstance(early, WaitForPeers)
    assert early.until_s == 5.0 + HANG_GRACE_S
    late = decide(book, fault_at=NOW - 5.0 - HANG_GRACE_S - 0.1)
    assert isinstance(late, FallBack)
    assert "no rank said it lost its group" in late.reason


def test_ranks_that_report_no_collective_timeout_fall_back_at_once() -> None:
    """A job that opted in but does not run ``elastic.run``: nothing will tell its ranks
    apart, so a hang goes the old way without a wait."""
    d = decide({r: beacon(r, age=10.0, timeout=None) for r in range(4)})
    assert isinstance(d, FallBack)
    assert "no collective timeout" in d.reason


def test_the_other_nodes_get_time_to_say_they_lost_it_too() -> None:
    fresh = {0: beacon(0, age=0.2, lost=0)} | {r: beacon(r, age=10.0) for r in (1, 2, 3)}
    assert isinstance(decide(fresh), WaitForPeers)
    settled = {0: beacon(0, age=1.6, lost=0)} | {r: beacon(r, age=10.0) for r in (1, 2, 3)}
    d = decide(settled)
    assert isinstance(d, RecoverInProcess)
    assert d.replaced == (1, 2, 3)


def test_every_rank_lost_its_group_and_none_is_replaced() -> None:
    d = decide({r: beacon(r, age=3.0, lost=0) for r in range(4)})
    assert isinstance(d, RecoverInProcess)
    assert d.replaced == () and "every rank lost its group" in d.reason


def test_a_loss_of_an_older_generation_says_nothing_of_this_one() -> None:
    book = {r: beacon(r, age=2.0, lost=0) for r in (0, 1, 2)} | {3: beacon(3, age=10.0)}
    d = decide(book, attempt=attempt(generation=1), fault_at=NOW - 3.0)
    assert isinstance(d, WaitForPeers)  # generation 1 runs: a loss of 0 is old news
    book = {r: beacon(r, age=2.0, lost=1) for r in (0, 1, 2)} | {3: beacon(3, age=10.0)}
    d = decide(book, attempt=attempt(generation=1))
    assert isinstance(d, RecoverInProcess) and d.generation == 2


def test_ranks_that_ended_are_neither_waiting_nor_silent() -> None:
    rows = ranks()
    rows[2] = replace(rows[2], state=RankState.EXITED, exit_code=0, ended_at=NOW - 1)
    book = {r: beacon(r, age=2.0, lost=0) for r in (0, 1)} | {3: beacon(3, age=10.0)}
    d = decide(book, ranks=rows)
    assert isinstance(d, RecoverInProcess) and d.replaced == (3,)


def test_a_silent_rank_on_an_unhealthy_node_or_no_restarts_left_falls_back() -> None:
    book = {r: beacon(r, age=2.0, lost=0) for r in (0, 1, 2)} | {3: beacon(3, age=10.0)}
    sick = decide(book, healthy_nodes=frozenset({"a"}))
    assert isinstance(sick, FallBack) and "b is not healthy" in sick.reason
    spent = decide(book, restarts_left=0)
    assert isinstance(spent, FallBack) and "no restarts left" in spent.reason


def test_a_silent_rank_whose_agent_went_quiet_is_left_to_the_liveness_watchdog() -> None:
    """Node b's agent was last heard before the others lost their group: b may be lost
    (its ranks then move to a free node, the rung's other path), so the rung waits."""
    book = {r: beacon(r, age=2.0, lost=0) for r in (0, 1, 2)} | {3: beacon(3, age=10.0)}
    lost_at = NOW - 2.0
    quiet = decide(book, heard={"a": NOW, "b": lost_at - 0.5})
    assert isinstance(quiet, WaitForPeers)
    alive = decide(book, heard={"a": NOW, "b": lost_at + 0.5})
    assert isinstance(alive, RecoverInProcess) and alive.replaced == (3,)


def test_group_lost_names_the_ranks_that_said_so_and_when_progress_stopped() -> None:
    book = {r: beacon(r, age=2.0, lost=0) for r in (0, 1)} | {3: beacon(3, age=10.0)}
    book[2] = beacon(2, age=2.0)
    got = progress.group_lost(book, generation=0, now=NOW)
    assert got is not None
    reason, fault_at, rank = got
    assert reason.startswith("rank 0, 1 lost its process group of generation 0")
    assert (fault_at, rank) == (NOW - 10.0, None)
    assert progress.group_lost(book, generation=1, now=NOW) is None  # old news
    assert progress.group_lost({3: beacon(3, age=10.0)}, generation=0, now=NOW) is None
