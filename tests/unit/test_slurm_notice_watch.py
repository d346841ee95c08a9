"""An agent inside a Slurm allocation: the batch trap's notice file becomes trainpod's notice
to the ranks running there (the notice file and signal of a preempted attempt's kill order)."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from trainpod.agent.launcher import Launcher
from trainpod.agent.ranks import Notice, notice_file
from trainpod.agent.slurmnotice import (
    CONFIRM_S,
    TERM_WAIT_S,
    Kind,
    SlurmNoticeWatch,
    classify,
    parse_job,
)
from trainpod.api.models import LaunchOrder, RankSlot
from trainpod.testing.wait import wait_until

# Exits 0 on the notice signal, as a script that saved on the notice does.
RANK = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)


def test_the_notice_file_gives_each_running_attempt_the_notice_and_is_reported(
    tmp_path: Path,
) -> None:
    changes: list[int] = []
    launcher = Launcher(node_env={"TRAINPOD_NODE": "n1"}, on_change=lambda: None)
    path = tmp_path / "slurm-notice-5.0"
    watch = _watch(
        launcher,
        path,
        on_notice=lambda: changes.append(1),
    )
    stopping = threading.Event()
    log_dir = tmp_path / "attempt-1"
    order = LaunchOrder(
        attempt_id=1,
        job_id=1,
        attempt_number=1,
        argv=[sys.executable, "-c", RANK],
        workdir=str(tmp_path),
        env={},
        ranks=[RankSlot(rank=r, local_rank=r) for r in range(2)],
        log_dir=str(log_dir),
    )
    thread = threading.Thread(target=watch.run, args=(stopping,), daemon=True)
    try:
        assert launcher.launch(order)
        logs = [log_dir / f"rank-{r}.log" for r in range(2)]
        wait_until(lambda: all(p.exists() and "ready" in p.read_text() for p in logs))
        thread.start()
        assert not watch.check() and watch.preempted_at is None and not changes
        path.write_text("1796130171\n")  # what the batch script's trap writes
        wait_until(lambda: watch.preempted_at is not None, what="the watch to see the file")
        assert watch.preempted_at == 1796130171.0

        def ended() -> list[tuple[int | None, int | None]] | None:
            (rep,) = launcher.reports()
            done = all(r.state == "exited" for r in rep.ranks)
            return [(r.exit_code, r.signal) for r in rep.ranks] if done else None

        assert wait_until(ended, timeout_s=60, what="the ranks to exit") == [(0, None)] * 2
        assert notice_file(log_dir, "n1").exists()  # the ranks' own notice file too
        assert changes  # reported at once
    finally:
        stopping.set()
        launcher.kill_everything()


# `scontrol show job -o` on Slurm 22.05.8 (slurm-ci), the fields classify reads, as measured:
# the --signal of a job chosen for preemption (partition low, GraceTime=15) ...
PREEMPTING = (
    "JobId=1 JobName=probe.sh JobState=RUNNING Reason=None Restarts=0 TimeLimit=00:02:00 "
    "StartTime=2026-12-01T18:08:10 EndTime=2026-12-01T18:08:41 "
    "PreemptEligibleTime=2026-12-01T18:08:10 PreemptTime=2026-12-01T18:08:26 SuspendTime=None"
)
# ... the same --signal sent 50 s before --time=1 ran out (partition debug, not preemptible) ...
WARNING = (
    "JobId=4 JobName=probe.sh JobState=RUNNING Reason=None Restarts=0 TimeLimit=00:01:00 "
    "StartTime=2026-12-01T18:08:56 EndTime=2026-12-01T18:09:56 SuspendTime=None"
)
# ... the preemption's SIGTERM (no user signal) while Slurm still delivers it (one agent of two
# asked in that moment; the other saw RUNNING) ...
SIGNALING = (
    "JobState=SIGNALING Reason=None Restarts=0 TimeLimit=365-00:00:00 "
    "StartTime=2026-12-03T20:08:34 EndTime=2026-12-03T20:09:11 PreemptTime=2026-12-03T20:08:41"
)
# ... and the SIGTERM at the end of a grace, the job already requeued.
ENDING = (
    "JobId=1 JobState=COMPLETING Reason=None Restarts=1 TimeLimit=00:02:00 "
    "StartTime=2026-12-01T18:08:41 EndTime=2026-12-01T18:10:41 SuspendTime=None"
)


def test_slurms_record_tells_a_preemption_from_the_time_limits_warning() -> None:
    assert classify(parse_job(PREEMPTING)) is Kind.PREEMPTION
    assert classify(parse_job(WARNING)) is Kind.TIME_LIMIT
    assert classify(parse_job(ENDING)) is Kind.ENDING
    assert classify(parse_job(SIGNALING)) is Kind.PREEMPTION  # a state flag, still running
    signaling = WARNING.replace("JobState=RUNNING", "JobState=SIGNALING")
    assert classify(parse_job(signaling)) is Kind.TIME_LIMIT
    for ended in ("CANCELLED", "TIMEOUT", "COMPLETED", "FAILED", "NODE_FAIL"):
        assert classify(parse_job(PREEMPTING.replace("RUNNING", ended))) is Kind.ENDING
    # A Slurm that shows no PreemptTime: the end pulled in before start + limit says it.
    pulled_in = PREEMPTING.replace("PreemptTime=2026-12-01T18:08:26", "")
    assert classify(parse_job(pulled_in)) is Kind.PREEMPTION
    none_yet = PREEMPTING.replace("PreemptTime=2026-12-01T18:08:26", "PreemptTime=None")
    assert classify(parse_job(none_yet)) is Kind.PREEMPTION
    unlimited = WARNING.replace("TimeLimit=00:01:00", "TimeLimit=UNLIMITED")
    assert classify(parse_job(unlimited)) is Kind.UNKNOWN
    days = WARNING.replace("TimeLimit=00:01:00", "TimeLimit=1-00:01:00")
    assert classify(parse_job(days)) is Kind.PREEMPTION  # ends a day before its limit
    assert classify({}) is Kind.UNKNOWN


def _watch(
    launcher: Launcher,
    path: Path | None,
    *,
    on_notice: Callable[[], None] = lambda: None,
    ask: Callable[[], Mapping[str, str]] = dict,
    term_wait_s: float = TERM_WAIT_S,
    confirm_s: float = CONFIRM_S,
) -> SlurmNoticeWatch:
    """A watch over ``launcher`` that gives SIGUSR1 with a 30 s grace, as slurm-ci's spec."""
    return SlurmNoticeWatch(
        path,
        Notice(signal.SIGUSR1, 30.0, "preempted by Slurm"),
        launcher,
        teardown_grace_s=1.0,
        on_notice=on_notice,
        ask=ask,
        term_wait_s=term_wait_s,
        confirm_s=confirm_s,
    )


def _two_ranks(tmp_path: Path, launcher: Launcher) -> Path:
    log_dir = tmp_path / "attempt-1"
    order = LaunchOrder(
        attempt_id=1,
        job_id=1,
        attempt_number=1,
        argv=[sys.executable, "-c", RANK],
        workdir=str(tmp_path),
        env={},
        ranks=[RankSlot(rank=r, local_rank=r) for r in range(2)],
        log_dir=str(log_dir),
    )
    assert launcher.launch(order)
    logs = [log_dir / f"rank-{r}.log" for r in range(2)]
    wait_until(lambda: all(p.exists() and "ready" in p.read_text() for p in logs))
    return log_dir


def _running(launcher: Launcher) -> bool:
    return all(r.state == "running" for rep in launcher.reports() for r in rep.ranks)


def test_the_time_limits_warning_is_not_a_preemption_and_a_later_preemption_is(
    tmp_path: Path,
) -> None:
    launcher = Launcher(node_env={"TRAINPOD_NODE": "n1"}, on_change=lambda: None)
    path = tmp_path / "slurm-notice-4.0"
    says = [parse_job(WARNING)]
    watch = _watch(
        launcher,
        path,
        ask=lambda: says[0],
    )
    try:
        log_dir = _two_ranks(tmp_path, launcher)
        path.write_text("1796148545\n")
        assert not watch.check()
        assert (watch.preempted_at, watch.time_limit_at) == (None, 1796148545.0)
        assert not watch.check()  # the same warning is not asked about again
        assert _running(launcher) and not notice_file(log_dir, "n1").exists()

        says[0] = parse_job(PREEMPTING)  # the trap writes the file again: now a preemption
        path.write_text("1796148600\n")
        assert watch.check() and watch.preempted_at == 1796148600.0
        wait_until(lambda: not _running(launcher), timeout_s=60, what="the ranks to exit")
        assert notice_file(log_dir, "n1").exists()
    finally:
        launcher.kill_everything()


def test_a_sigterm_that_is_slurms_preemption_is_the_notice_and_the_agent_stays(
    tmp_path: Path,
) -> None:
    launcher = Launcher(node_env={"TRAINPOD_NODE": "n1"}, on_change=lambda: None)
    asked = threading.Event()
    release = threading.Event()

    def ask() -> dict[str, str]:
        asked.set()
        release.wait(30)  # Slurm takes its time to answer
        return parse_job(PREEMPTING)

    stops: list[int] = []
    watch = _watch(
        launcher,
        None,
        ask=ask,
    )
    try:
        log_dir = _two_ranks(tmp_path, launcher)
        assert watch.takes_sigterm()
        watch.sigterm(lambda: stops.append(1))
        asked.wait(30)
        settled = threading.Thread(target=watch.settle)
        settled.start()
        settled.join(0.2)
        assert settled.is_alive()  # reports wait while Slurm is asked
        release.set()
        settled.join(30)
        assert not settled.is_alive()
        assert watch.preempted_at is not None and not stops
        assert not watch.takes_sigterm()  # the next SIGTERM is the grace's end
        wait_until(lambda: not _running(launcher), timeout_s=60, what="the ranks to exit")
        assert notice_file(log_dir, "n1").exists()
    finally:
        release.set()
        launcher.kill_everything()


def test_a_sigterm_that_is_not_a_preemption_stops_the_agent(tmp_path: Path) -> None:
    launcher = Launcher(node_env={"TRAINPOD_NODE": "n1"}, on_change=lambda: None)
    for said in (ENDING, WARNING, ""):
        stopped = threading.Event()
        watch = _watch(
            launcher,
            None,
            ask=functools.partial(parse_job, said),
            confirm_s=0.0 if said != ENDING else 3600.0,  # "ending" is believed at once
        )
        watch.sigterm(stopped.set)
        assert stopped.wait(30), said
        watch.settle()
        assert watch.preempted_at is None


def test_a_sigterm_whose_preemption_slurms_record_shows_late_is_still_the_notice(
    tmp_path: Path,
) -> None:
    """Right after Slurm's preemption SIGTERM, ``scontrol`` can still show the job running
    with no PreemptTime (seen on a loaded box): the check asks again before it decides."""
    launcher = Launcher(node_env={"TRAINPOD_NODE": "n1"}, on_change=lambda: None)
    unlimited = PREEMPTING.replace("TimeLimit=00:02:00", "TimeLimit=UNLIMITED")
    not_yet = unlimited.replace("PreemptTime=2026-12-01T18:08:26", "PreemptTime=None")
    answers = [not_yet, not_yet, unlimited]
    asked: list[int] = []

    def ask() -> dict[str, str]:
        asked.append(1)
        return parse_job(answers[min(len(asked), len(answers)) - 1])

    stops: list[int] = []
    watch = _watch(
        launcher,
        None,
        ask=ask,
        confirm_s=3600.0,
    )
    assert classify(parse_job(not_yet)) is Kind.UNKNOWN  # what a single look would decide
    try:
        _two_ranks(tmp_path, launcher)
        watch.sigterm(lambda: stops.append(1))
        watch.settle(timeout_s=60)
        assert len(asked) == 3
        assert watch.preempted_at is not None and not stops
        wait_until(lambda: not _running(launcher), timeout_s=60, what="the ranks to exit")
    finally:
        launcher.kill_everything()


def test_reports_wait_for_the_agents_sigterm_when_a_rank_died_of_slurms_first(
    tmp_path: Path,
) -> None:
    """Slurm signals the whole tree: a rank's exit can be seen before the agent's handler
    runs; the beat that would carry it waits for the handler and Slurm's answer."""
    launcher = Launcher(node_env={"TRAINPOD_NODE": "n1"}, on_change=lambda: None)
    watch = _watch(
        launcher,
        None,
        ask=lambda: parse_job(PREEMPTING),
        term_wait_s=60.0,
    )
    try:
        _two_ranks(tmp_path, launcher)
        (rep,) = launcher.reports()
        pid = rep.ranks[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGTERM)  # Slurm's, before the agent has heard of it
        wait_until(lambda: launcher.sigtermed() == {(1, 0)}, what="the rank to die of it")
        seen: list[float | None] = []

        def one_beat() -> None:
            watch.settle()
            seen.append(watch.preempted_at)

        beat = threading.Thread(target=one_beat)
        beat.start()
        beat.join(0.5)
        assert beat.is_alive() and not seen  # held: the agent has not heard its SIGTERM yet
        watch.sigterm(lambda: None)  # the agent's handler, later
        beat.join(60)
        assert seen and seen[0] is not None  # the beat goes out with the preemption
        watch.settle()  # the same rank is not waited for twice
    finally:
        launcher.kill_everything()


def test_a_sigterm_the_launcher_sent_itself_is_not_waited_for(tmp_path: Path) -> None:
    launcher = Launcher(node_env={"TRAINPOD_NODE": "n1"}, on_change=lambda: None)
    try:
        _two_ranks(tmp_path, launcher)
        assert launcher.kill(1, grace_s=30.0)  # the controller's kill: SIGTERM, ours
        wait_until(lambda: not _running(launcher), timeout_s=60, what="the ranks to exit")
        assert launcher.sigtermed() == set()
    finally:
        launcher.kill_everything()
