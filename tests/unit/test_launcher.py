"""Stopping an attempt's ranks: SIGTERM to each rank's process group, SIGKILL after the
grace, and each rank's report keeps the signal that ended it."""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

import pytest

from trainpod.agent.launcher import Launcher
from trainpod.agent.ranks import RankProcess, open_log, write_notice
from trainpod.agent.warmpool import WarmPool
from trainpod.api.models import LaunchOrder, RankReport, RankSlot, RecoverOrder
from trainpod.testing.wait import wait_until

# Says "ready" in its log once its signal handling is set up.
RANK = "import signal, time\n{setup}\nprint('ready', flush=True)\ntime.sleep(120)"


def _launch(tmp_path: Path, launcher: Launcher, attempt: int, setup: str = "") -> None:
    order = LaunchOrder(
        attempt_id=attempt,
        job_id=1,
        attempt_number=attempt,
        argv=[sys.executable, "-c", RANK.format(setup=setup)],
        workdir=str(tmp_path),
        env={},
        ranks=[RankSlot(rank=r, local_rank=r) for r in range(2)],
        log_dir=str(tmp_path / f"attempt-{attempt}"),
    )
    assert launcher.launch(order)
    logs = [tmp_path / f"attempt-{attempt}" / f"rank-{r}.log" for r in range(2)]
    wait_until(
        lambda: all(p.exists() and "ready" in p.read_text() for p in logs),
        what="the ranks to start",
    )


def _ended(launcher: Launcher, attempt: int) -> list[RankReport]:
    def done() -> list[RankReport] | None:
        (rep,) = [a for a in launcher.reports() if a.attempt_id == attempt]
        return rep.ranks if all(r.state == "exited" for r in rep.ranks) else None

    return wait_until(done, timeout_s=60, what=f"attempt {attempt} to end")


def test_a_killed_attempt_reports_the_signal_of_each_rank(tmp_path: Path) -> None:
    launcher = Launcher(node_env={}, on_change=lambda: None)
    try:
        _launch(tmp_path, launcher, 1)
        launcher.kill(1, grace_s=30)
        assert [(r.signal, r.exit_code) for r in _ended(launcher, 1)] == [
            (signal.SIGTERM, None)
        ] * 2
        _launch(tmp_path, launcher, 2, "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
        launcher.kill(2, grace_s=0.5)
        assert [(r.signal, r.exit_code) for r in _ended(launcher, 2)] == [
            (signal.SIGKILL, None)
        ] * 2
    finally:
        launcher.kill_everything()


def test_an_attempt_whose_first_rank_ended_and_was_acknowledged_still_reports_the_rest(
    tmp_path: Path,
) -> None:
    """The reporter may send (and the controller acknowledge) rank 0's exit while rank 1 is
    still being spawned; the attempt must stay until rank 1's exit is reported too."""
    launcher = Launcher(node_env={}, on_change=lambda: None)
    spawn = launcher._spawn
    acknowledged: list[list[int]] = []

    def spawn_then_report(order: LaunchOrder, rp: RankProcess) -> None:
        spawn(order, rp)
        if rp.rank == 0:  # what the reporter thread does between two spawns
            wait_until(
                lambda: launcher.reports()[0].ranks[0].state == "exited",
                what="rank 0 to end",
            )
            reports = launcher.reports()
            acknowledged.append([r.rank for r in reports[0].ranks])
            launcher.delivered(reports)

    launcher._spawn = spawn_then_report  # type: ignore[method-assign]
    order = LaunchOrder(
        attempt_id=1,
        job_id=1,
        attempt_number=1,
        argv=["true"],
        workdir=str(tmp_path),
        env={},
        ranks=[RankSlot(rank=r, local_rank=r) for r in range(2)],
        log_dir=str(tmp_path / "attempt-1"),
    )
    assert launcher.launch(order)
    assert acknowledged == [[0, 1]]
    assert [(r.rank, r.exit_code) for r in _ended(launcher, 1)] == [(0, 0), (1, 0)]


def test_an_attempt_is_reported_or_listed_forgotten_from_its_launch_on(tmp_path: Path) -> None:
    """``report()`` reads the reports and the forgotten attempts together: an attempt whose
    every exit was acknowledged moves from one to the other, never missing from both."""
    launcher = Launcher(node_env={}, on_change=lambda: None)
    assert launcher.report() == ([], [])
    order = LaunchOrder(
        attempt_id=7,
        job_id=1,
        attempt_number=1,
        argv=["true"],
        workdir=str(tmp_path),
        env={},
        ranks=[RankSlot(rank=0, local_rank=0)],
        log_dir=str(tmp_path / "attempt-7"),
    )
    assert launcher.launch(order)
    reports, forgotten = launcher.report()
    assert [r.attempt_id for r in reports] == [7] and forgotten == []
    (ended,) = _ended(launcher, 7)
    assert ended.exit_code == 0
    launcher.delivered(launcher.reports())
    assert launcher.report() == ([], [7])


def test_ranks_of_an_in_process_job_are_told_where_their_recover_file_is(tmp_path: Path) -> None:
    """ADR 0026: one recover file per node and job, in the job's scratch directory."""
    launcher = Launcher(node_env={"TRAINPOD_SCRATCH_DIR": str(tmp_path)}, on_change=lambda: None)
    show = "import os; print(os.environ.get('TRAINPOD_RECOVER_FILE', 'none'), flush=True)"
    for attempt, env in ((1, {"TRAINPOD_RECOVERY": "in-process"}), (2, {})):
        order = LaunchOrder(
            attempt_id=attempt,
            job_id=4,
            attempt_number=attempt,
            argv=[sys.executable, "-c", show],
            workdir=str(tmp_path),
            env=env,
            ranks=[RankSlot(rank=0, local_rank=0)],
            log_dir=str(tmp_path / f"attempt-{attempt}"),
        )
        assert launcher.launch(order)
        assert [r.exit_code for r in _ended(launcher, attempt)] == [0]
    said = [(tmp_path / f"attempt-{a}" / "rank-0.log").read_text().strip() for a in (1, 2)]
    assert said == [str(tmp_path / "job-4" / "recover.json"), "none"]


def test_a_notice_is_written_whole_and_never_through_a_link_left_at_its_tmp_path(
    tmp_path: Path,
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    notice = tmp_path / "notice.json"
    (tmp_path / ".notice.json.tmp").symlink_to(victim)  # what an account could leave there
    write_notice(notice, b'{"signal": "SIGUSR1"}', None)
    assert victim.read_text() == "keep"
    assert notice.read_text() == '{"signal": "SIGUSR1"}' and not notice.is_symlink()
    assert stat.S_IMODE(notice.stat().st_mode) == 0o600


def test_an_accounts_rank_log_is_0600_and_not_opened_through_a_link(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"old\n")
    log.chmod(0o644)
    with open_log(log, private=True) as f:
        f.write(b"new\n")
    assert log.read_bytes() == b"old\nnew\n"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    linked = tmp_path / "rank-1.log"
    linked.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        open_log(linked, private=True).close()
    assert not (tmp_path / "elsewhere").exists()
    assert os.path.islink(linked)


def test_an_in_process_run_whose_only_rank_failed_waits_for_its_recover_order(
    tmp_path: Path,
) -> None:
    """A node with one rank of an in-process job: its exit is delivered before the recover
    order comes; the run must still be there for the order to start the rank again."""
    from trainpod.api.models import RecoverOrder

    launcher = Launcher(node_env={"TRAINPOD_SCRATCH_DIR": str(tmp_path)}, on_change=lambda: None)
    order = LaunchOrder(
        attempt_id=7,
        job_id=1,
        attempt_number=1,
        argv=[
            sys.executable,
            "-c",
            "import os, sys; sys.exit(int(os.environ.get('TRAINPOD_RECOVER_GENERATION', '3')))",
        ],
        workdir=str(tmp_path),
        env={"TRAINPOD_RECOVERY": "in-process"},
        ranks=[RankSlot(rank=1, local_rank=0)],
        log_dir=str(tmp_path / "attempt-7"),
    )
    try:
        assert launcher.launch(order)
        (rank,) = _ended(launcher, 7)
        assert rank.exit_code == 3
        launcher.delivered(launcher.reports())
        recover = RecoverOrder(
            attempt_id=7,
            generation=1,
            master_addr="127.0.0.1",
            master_port=29600,
            world_size=2,
            replaced=[1],
            respawn=[1],
        )
        assert launcher.recover(recover)  # the run was kept: the rank starts again
        (again,) = _ended(launcher, 7)
        assert again.exit_code == 1  # TRAINPOD_RECOVER_GENERATION=1 this time
    finally:
        launcher.kill_everything()


def test_a_late_acknowledgement_of_an_exit_does_not_forget_a_rank_started_again(
    tmp_path: Path,
) -> None:
    """In-process recovery (ADR 0026): the only rank here failed, its exit was
    acknowledged, and the recover order started it again. A reply to a beat read before
    the restart (the agent's other thread, late) acknowledges the old process's exit
    again: the new process must stay reported, and killable. In a chaos run the run was
    forgotten instead; the controller never saw the rank running and gave the recovery up,
    and the new process ran on beside the next attempt's."""
    launcher = Launcher(node_env={"TRAINPOD_SCRATCH_DIR": str(tmp_path)}, on_change=lambda: None)
    code = (  # fails, and runs once started again in a generation
        "import os, sys, time\n"
        "if not os.environ.get('TRAINPOD_RECOVER_GENERATION'): sys.exit(3)\n"
        "time.sleep(120)"
    )
    order = LaunchOrder(
        attempt_id=5,
        job_id=1,
        attempt_number=1,
        argv=[sys.executable, "-c", code],
        workdir=str(tmp_path),
        env={"TRAINPOD_RECOVERY": "in-process"},
        ranks=[RankSlot(rank=0, local_rank=0)],
        log_dir=str(tmp_path / "attempt-5"),
    )
    assert launcher.launch(order)
    (failed,) = _ended(launcher, 5)
    assert failed.exit_code == 3
    stale = launcher.reports()  # read before the restart
    launcher.delivered(stale)  # acknowledged: the run is kept for its recover order
    recover = RecoverOrder(
        attempt_id=5, generation=1, master_addr="127.0.0.1", master_port=29500,
        world_size=2, replaced=[0], respawn=[0], deadline_s=10,
    )  # fmt: skip
    assert launcher.recover(recover)
    try:
        launcher.delivered(stale)  # the late one
        (rep,) = launcher.reports()
        assert [r.state for r in rep.ranks] == ["running"]
        assert rep.ranks[0].pid != failed.pid
        assert launcher.kill(5, grace_s=0.0)
        (killed,) = _ended(launcher, 5)
        assert killed.signal in (signal.SIGTERM, signal.SIGKILL)
    finally:
        launcher.kill(5, grace_s=0.0)


class GatedPool(WarmPool):
    """A warm pool whose zygote answers only when the test opens the gate (a zygote busy
    importing), then says "start cold"."""

    def __init__(self) -> None:
        super().__init__(None, None)
        self.gate = threading.Event()
        self.asked = threading.Event()

    def spawn(self, order: LaunchOrder, *, env: Mapping[str, str], log_path: Path) -> str:
        self.asked.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return "the test's zygote: start cold"


def _order(tmp_path: Path, attempt: int, ranks: int = 2) -> LaunchOrder:
    return LaunchOrder(
        attempt_id=attempt,
        job_id=1,
        attempt_number=attempt,
        argv=[sys.executable, "-c", RANK.format(setup="")],
        workdir=str(tmp_path),
        env={},
        ranks=[RankSlot(rank=r, local_rank=r) for r in range(ranks)],
        log_dir=str(tmp_path / f"attempt-{attempt}"),
    )


def test_a_launch_that_does_not_wait_returns_before_a_slow_start_and_reports_its_ranks(
    tmp_path: Path,
) -> None:
    """The agent's heartbeat threads launch so: a rank's start that waits for a busy zygote
    must never hold a beat (a missed beat reads as a lost node)."""
    pool = GatedPool()
    launcher = Launcher(node_env={}, on_change=lambda: None, warm=pool)
    try:
        assert launcher.launch(_order(tmp_path, 1), wait=False)  # returns with the gate shut
        assert pool.asked.wait(30)
        (rep,) = launcher.reports()
        assert [(r.rank, r.state, r.pid) for r in rep.ranks] == [
            (0, "running", None),
            (1, "running", None),
        ]
        assert not launcher.launch(_order(tmp_path, 1), wait=False)  # still idempotent
        pool.gate.set()
        wait_until(lambda: len(launcher.pids()) == 2, what="both ranks started")
    finally:
        pool.gate.set()
        launcher.shutdown(1.0)


def test_a_kill_while_the_ranks_start_stops_the_started_and_starts_no_more(
    tmp_path: Path,
) -> None:
    """Killed while its first rank's start waits: that rank, started after the teardown
    looked, is killed at once, and the second is never started."""
    pool = GatedPool()
    launcher = Launcher(node_env={}, on_change=lambda: None, warm=pool)
    try:
        assert launcher.launch(_order(tmp_path, 1), wait=False)
        assert pool.asked.wait(30)
        assert launcher.kill(1, grace_s=30)  # the teardown finds no process yet
        pool.gate.set()
        ranks = _ended(launcher, 1)
        assert [(r.rank, r.signal) for r in ranks] == [(0, signal.SIGKILL), (1, signal.SIGKILL)]
        assert ranks[0].pid is not None  # started, then killed
        assert ranks[1].pid is None  # never started
        assert launcher.pids() == []
    finally:
        pool.gate.set()
        launcher.shutdown(1.0)
