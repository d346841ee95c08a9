"""Deciding what an attempt's rank states mean: a pure function, stepped by tests.

An attempt succeeds when every rank exited 0. When any rank fails (non-zero exit, a
signal, or lost with its node) the attempt goes to ``stopping`` and every other rank is
torn down; once every rank that started has ended it is ``failed``. A cancel request takes
the same path and ends ``cancelled``. Whether a failed attempt is retried is the recovery
policy's call, not this module's.

A rank being started again by an in-process recovery (``recovering``, ADR 0026) is neither
failed nor ended: its attempt goes on while the recovery lasts.

A rank that aborted in its interpreter's teardown (``teardown``: SIGABRT with
libstdc++'s "terminate called without an active exception" and no traceback, ADR 0044) is
not a failure yet: a script that never destroyed its Gloo process group may die so after
finishing (pytorch/pytorch#179291). When every other rank exited 0, they all ran their
collectives to the end with it, and the attempt succeeded; while others still run it waits
up to ``teardown_abort_wait_s`` after the abort; if another rank fails, or the wait runs
out, or no other rank can vouch for it (a world of one), it is the failure it looks like.

A rank left running, idle, after every other rank exited 0 (:func:`left_idle`, ADR 0049)
is stuck in its own teardown (``destroy_process_group`` may hang when a peer has already
gone, pytorch/pytorch#75097): the watchdog stops the attempt with ``CAUSE_LEFT_IDLE``, and
once it is torn down it succeeded, as Slurm ends a step's tasks ``WaitTime`` after the first
one ended.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from trainpod.model.failures import Failure
from trainpod.model.states import AttemptState, RankState
from trainpod.store.rows import AttemptRow, RankRow

CAUSE_CANCEL = "cancelled"
CAUSE_RANK_FAILED = "crash"  # a rank exited non-zero or by a signal
CAUSE_NODE_LOST = "node_lost"
CAUSE_PREEMPTED = "preempted"  # stopped for another job: no fault, requeued
CAUSE_TIME_LIMIT = "time_limit"  # ran past its --time: the job ends (not the job's fault)
CAUSE_LEFT_IDLE = "left_idle"  # a rank idle after every other one exited 0: a success
RANK_EXIT_KEYS = frozenset({"rank", "node", "exit_code", "signal", "lost", "log_tail"})
"""The keys a rank's failure record always has (``exit_code`` or ``signal`` null)."""


TEARDOWN_ABORT_WAIT_S = 30.0
"""How long a rank's teardown abort waits for the others to end before it is a failure."""


@dataclass(frozen=True)
class Verdict:
    state: AttemptState
    cause: str = ""
    failure: Failure = field(default_factory=Failure)
    note: str = ""
    """For humans, on a success that forgave a teardown abort: which rank, and why."""


def first_failure(ranks: Sequence[RankRow], tails: dict[int, str]) -> Failure | None:
    """The earliest failed rank, as a failure record, or None."""
    failed = [r for r in ranks if r.failed]
    if not failed:
        return None
    r = min(failed, key=lambda x: (x.ended_at or float("inf"), x.rank))
    return Failure(
        rank=r.rank,
        node=r.node,
        exit_code=r.exit_code,
        signal=r.signal,
        lost=r.state is RankState.LOST,
        log_tail=tails.get(r.rank, ""),
        nulls=RANK_EXIT_KEYS,
    )


def judge(
    attempt: AttemptRow,
    ranks: Sequence[RankRow],
    *,
    cancel_requested: bool,
    tails: dict[int, str] | None = None,
    recovering: frozenset[int] = frozenset(),
    teardown: frozenset[int] = frozenset(),
    now: float | None = None,
    teardown_abort_wait_s: float = TEARDOWN_ABORT_WAIT_S,
) -> Verdict | None:
    """The attempt's next state, or None when it stays as it is."""
    if attempt.state.ended:
        return None
    tails = tails or {}
    if recovering:
        ranks = [r for r in ranks if r.rank not in recovering]
        if not ranks:
            return None
    if attempt.state is not AttemptState.STOPPING and not cancel_requested:
        forgiven = _teardown_aborts(ranks, teardown, now, teardown_abort_wait_s)
        if forgiven == "wait":
            return None
        if forgiven is not None:
            return forgiven
    all_ended = all(r.state.ended for r in ranks)
    # Teardown waits only for ranks that started: once an attempt stops, its nodes get kill
    # orders instead of launch orders, so a pending rank never starts (and an agent that
    # reports one anyway is told to kill it once the attempt has ended).
    torn_down = all(r.state.ended or r.state is RankState.PENDING for r in ranks)
    failure = first_failure(ranks, tails)

    if attempt.state is AttemptState.STOPPING:
        if not torn_down:
            return None
        if attempt.cause == CAUSE_CANCEL:
            return Verdict(AttemptState.CANCELLED, CAUSE_CANCEL, attempt.failure)
        if attempt.cause == CAUSE_LEFT_IDLE:  # its work was done: no failure either way
            if cancel_requested:
                return Verdict(AttemptState.CANCELLED, CAUSE_CANCEL)
            return Verdict(AttemptState.SUCCEEDED, note=attempt.failure.reason or "")
        return Verdict(AttemptState.FAILED, attempt.cause, attempt.failure)

    if cancel_requested:
        if torn_down:
            return Verdict(AttemptState.CANCELLED, CAUSE_CANCEL)
        return Verdict(AttemptState.STOPPING, CAUSE_CANCEL)
    if failure is not None:
        cause = CAUSE_NODE_LOST if failure.lost else CAUSE_RANK_FAILED
        if torn_down:
            return Verdict(AttemptState.FAILED, cause, failure)
        return Verdict(AttemptState.STOPPING, cause, failure)
    if all_ended:
        return Verdict(AttemptState.SUCCEEDED)
    if attempt.state is AttemptState.LAUNCHING and all(
        r.state is not RankState.PENDING for r in ranks
    ):
        return Verdict(AttemptState.RUNNING)
    return None


def _teardown_aborts(
    ranks: Sequence[RankRow], teardown: frozenset[int], now: float | None, wait_s: float
) -> Verdict | Literal["wait"] | None:
    """A success, "wait", or None (judge the ranks as usual) for teardown aborts."""
    aborted = [r for r in ranks if r.rank in teardown and r.state is RankState.EXITED]
    aborted = [r for r in aborted if r.failed]
    if not aborted:
        return None
    others = [r for r in ranks if r.rank not in teardown]
    if not others or any(r.failed for r in ranks if r not in aborted):
        return None
    if all(r.state is RankState.EXITED for r in others):  # and none failed: all exited 0
        which = ", ".join(str(r.rank) for r in aborted)
        note = (
            f"rank {which} aborted (SIGABRT) in its interpreter's teardown after every other "
            "rank exited 0: a process group never destroyed (pytorch/pytorch#179291); "
            "counted as a success"
        )
        return Verdict(AttemptState.SUCCEEDED, note=note)
    first = min((r.ended_at for r in aborted if r.ended_at is not None), default=None)
    if now is None or first is None or now - first < wait_s:
        return "wait"
    return None


def left_idle(
    ranks: Sequence[RankRow], idle_since: Mapping[int, float], now: float, wait_s: float
) -> tuple[int, ...]:
    """The ranks to stop because they stay running, idle, after their work is done: every
    other rank of the attempt exited 0 at least ``wait_s`` ago (they ran their collectives
    to the end with these), and each of these has used no CPU (``idle_since``: since when,
    by the controller's clock, as its agent measured it) for ``wait_s``. Empty while any
    rank is pending, lost or failed, while a running rank works or was not measured, and
    when ``wait_s`` is 0 (off)."""
    running = [r for r in ranks if r.state is RankState.RUNNING]
    done = [r for r in ranks if r.state is not RankState.RUNNING]
    if wait_s <= 0 or not running or not done:
        return ()
    if any(r.state is not RankState.EXITED or r.failed for r in done):
        return ()
    last_exit = max((r.ended_at for r in done if r.ended_at is not None), default=None)
    if last_exit is None or now - last_exit < wait_s:
        return ()
    for r in running:
        since = idle_since.get(r.rank)
        if since is None or now - since < wait_s:
            return ()
    return tuple(r.rank for r in running)


def describe_left_idle(stuck: Sequence[int], ranks: Sequence[RankRow], wait_s: float) -> str:
    """Why the attempt was stopped and still counts as a success, for humans."""
    which = ", ".join(str(r) for r in stuck)
    where = sorted({r.node for r in ranks if r.rank in stuck})
    return (
        f"rank {which} on {', '.join(where)} stayed running, idle (no CPU for {wait_s:g}s), "
        "after every other rank exited 0: stopped as stuck in its teardown "
        "(pytorch/pytorch#75097); counted as a success"
    )


def describe_failure(failure: Failure) -> str:
    """One line for humans: which rank failed where, and how."""
    if failure.empty:
        return ""
    where = f"rank {failure.rank} on {failure.node}"
    if failure.lost:
        return f"{where} was lost with its node"
    if failure.signal is not None:
        return f"{where} was killed by signal {failure.signal}"
    return f"{where} exited with code {failure.exit_code}"
