"""Ranks left running, idle, after their peers finished (ADR 0049): the pure rule the
watchdog applies (:func:`trainpod.controller.judge.left_idle`), the verdict once they are
torn down, and the agent's measure of idleness (:class:`trainpod.agent.idle.IdleMeter`) on
fake counters and on real processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from tests.unit.test_judge import attempt, rank

from trainpod.agent.idle import CHILDREN_WINDOW_S, WINDOW_S, IdleMeter, tree_cpu_s
from trainpod.controller.judge import (
    CAUSE_CANCEL,
    CAUSE_LEFT_IDLE,
    describe_left_idle,
    judge,
    left_idle,
)
from trainpod.model.failures import Failure
from trainpod.model.states import AttemptState, RankState
from trainpod.store.rows import RankRow
from trainpod.testing.wait import wait_until

A, R = AttemptState, RankState
PEERS_DONE = [rank(0, R.EXITED, code=0, ended_at=100.0), rank(1, R.EXITED, code=0, ended_at=110.0)]


# -- the rule ----------------------------------------------------------------------------
def test_a_rank_idle_for_the_wait_after_the_last_peer_ended_is_left_idle() -> None:
    ranks = [*PEERS_DONE, rank(2), rank(3)]
    idle = {2: 50.0, 3: 105.0}
    assert left_idle(ranks, idle, now=169.9, wait_s=60) == ()  # the last peer ended at 110
    assert left_idle(ranks, idle, now=170.0, wait_s=60) == (2, 3)


def test_every_running_rank_must_be_idle_for_the_whole_wait() -> None:
    ranks = [*PEERS_DONE, rank(2), rank(3)]
    assert left_idle(ranks, {2: 0.0, 3: 150.0}, now=200.0, wait_s=60) == ()
    assert left_idle(ranks, {2: 0.0}, now=200.0, wait_s=60) == ()  # 3 works (or unmeasured)


@pytest.mark.parametrize(
    "other",
    [
        rank(1, R.EXITED, code=1, ended_at=110.0),
        rank(1, R.EXITED, signal=9, ended_at=110.0),
        rank(1, R.LOST, ended_at=110.0),
        rank(1, R.PENDING),
    ],
    ids=["exit 1", "killed", "lost", "never started"],
)
def test_not_when_a_peer_did_not_exit_0(other: RankRow) -> None:
    ranks = [rank(0, R.EXITED, code=0, ended_at=100.0), other, rank(2)]
    assert left_idle(ranks, {2: 0.0}, now=1000.0, wait_s=60) == ()


def test_not_for_a_world_of_running_ranks_only_nor_with_the_wait_off() -> None:
    assert left_idle([rank(0), rank(1)], {0: 0.0, 1: 0.0}, now=1000.0, wait_s=60) == ()
    assert left_idle([*PEERS_DONE, rank(2)], {2: 0.0}, now=1000.0, wait_s=0) == ()


def test_once_torn_down_the_stopped_attempt_succeeded_with_the_reason() -> None:
    ranks = [*PEERS_DONE, rank(2, R.EXITED, signal=15, ended_at=180.0)]
    why = describe_left_idle((2,), ranks, 60)
    stopping = attempt(A.STOPPING, CAUSE_LEFT_IDLE, failure=Failure(reason=why))
    verdict = judge(stopping, ranks, cancel_requested=False)
    assert verdict is not None
    assert (verdict.state, verdict.note) == (A.SUCCEEDED, why)
    assert "rank 2 on n-1 stayed running, idle (no CPU for 60s)" in why
    still = judge(stopping, [*PEERS_DONE, rank(2)], cancel_requested=False)
    assert still is None  # waits for the SIGTERM to take
    cancelled = judge(stopping, ranks, cancel_requested=True)
    assert cancelled is not None  # a cancel meanwhile: cancelled, neither success nor failure
    assert (cancelled.state, cancelled.cause) == (A.CANCELLED, CAUSE_CANCEL)


# -- the measure --------------------------------------------------------------------------
class Counters:
    def __init__(self) -> None:
        self.now = 0.0
        self.own = 0.0
        self.children = 0.0
        self.gone = False

    def clock(self) -> float:
        return self.now

    def cpu(self, pid: int, *, children: bool) -> float | None:
        if self.gone:
            return None
        return self.own + (self.children if children else 0.0)


def test_idle_counts_from_the_last_report_that_saw_work() -> None:
    c = Counters()
    m = IdleMeter(clock=c.clock, cpu=c.cpu)
    assert m.idle_s(7) is None  # first sight: works
    for _ in range(3):
        c.now += 1.0
        c.own += 0.9
        assert m.idle_s(7) is None
    c.now += 1.0  # rests from now on (a tick now and then is not work)
    assert m.idle_s(7) is None  # its children not looked at yet
    c.now += 1.0
    c.own += 0.01
    assert m.idle_s(7) == pytest.approx(1.0)
    c.now += 30.0
    assert m.idle_s(7) == pytest.approx(31.0)
    c.now += 1.0
    c.children += 0.5  # an evaluation in a subprocess is work ...
    assert m.idle_s(7) == pytest.approx(32.0)  # ... seen at the next look at its children
    c.now += 4.0
    assert m.idle_s(7) is None
    c.now += 1.0
    assert m.idle_s(7) == pytest.approx(1.0)
    assert m.idle_s(8) is None  # another process of the rank starts afresh
    c.gone = True
    assert m.idle_s(8) is None


def test_a_report_sooner_than_the_window_repeats_the_previous_answer() -> None:
    c = Counters()
    m = IdleMeter(clock=c.clock, cpu=c.cpu)
    assert m.idle_s(7) is None
    c.now += 0.2
    c.own += 0.2  # busy all along, but too short a time to tell
    assert m.idle_s(7) is None
    c.now += 1.0
    c.own += 1.0
    assert m.idle_s(7) is None
    c.now += 1.0
    assert m.idle_s(7) is None  # resting: its children looked at from here
    c.now += 1.0
    assert m.idle_s(7) == pytest.approx(1.0)
    c.now += 0.5
    c.own += 0.5
    assert m.idle_s(7) == pytest.approx(1.5)  # within the window: as before
    c.now += 0.5
    assert m.idle_s(7) is None  # 0.5 s of CPU in the last second: it worked


def test_a_resting_rank_s_children_are_looked_at_once_per_window() -> None:
    c = Counters()
    looks: list[bool] = []

    def cpu(pid: int, *, children: bool) -> float | None:
        looks.append(children)
        return c.cpu(pid, children=children)

    m = IdleMeter(clock=c.clock, cpu=cpu)
    for _ in range(20):  # 20 s at rest, a report a second
        m.idle_s(7)
        c.now += 1.0
    assert looks.count(True) == 4  # at 1, 6, 11 and 16 s: not at every report


Start = Callable[[str], "subprocess.Popen[bytes]"]


@pytest.fixture
def start() -> Iterator[Start]:
    procs: list[subprocess.Popen[bytes]] = []

    def run(code: str) -> subprocess.Popen[bytes]:
        # a session of its own: its children go with it (a spinning grandchild left behind
        # would eat a core for the rest of the run)
        procs.append(subprocess.Popen([sys.executable, "-c", code], start_new_session=True))
        return procs[-1]

    yield run
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _measure(
    pids: list[int], until: Callable[[dict[int, list[float | None]]], bool]
) -> dict[int, list[float | None]]:
    """Every pid's meter read every 0.3 s until ``until`` says enough."""
    meters = {pid: IdleMeter() for pid in pids}
    seen: dict[int, list[float | None]] = {pid: [] for pid in pids}

    def probe() -> bool:
        for pid, m in meters.items():
            seen[pid].append(m.idle_s(pid))
        return until(seen)

    wait_until(probe, timeout_s=90, interval_s=0.3, what="enough measurements")
    return seen


def test_a_real_process_asleep_is_idle_and_a_spinning_one_is_not(start: Start) -> None:
    asleep = start("import time; time.sleep(600)")
    spinning = start("while True: pass")
    seen = _measure([asleep.pid, spinning.pid], lambda s: (s[asleep.pid][-1] or 0) > 2.0)
    assert seen[spinning.pid] == [None] * len(seen[spinning.pid])


def test_a_process_whose_child_works_is_not_idle(start: Start) -> None:
    parent = start(
        "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while True: pass'])"
    )
    wait_until(
        lambda: (tree_cpu_s(parent.pid, children=True) or 0) > 0.3,
        timeout_s=30,
        what="the parent's child to use CPU",
    )
    seen = _measure([parent.pid], lambda s: len(s[parent.pid]) >= 50)  # 15 s and more
    assert (tree_cpu_s(parent.pid, children=False) or 0) < 0.5  # the parent itself rests
    # idle at most between two looks at its children, never for a wait's worth
    longest = max((v or 0.0) for v in seen[parent.pid])
    assert longest < CHILDREN_WINDOW_S + 2 * WINDOW_S, seen[parent.pid]
