"""The process that holds an allocation's node: started by the real launcher, as an agent
starts it, it waits until told to stop and then exits 0 (an allocation ending is no fault),
whether it is stopped by the launcher's SIGTERM or by a SIGHUP."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from trainpod.agent.launcher import Launcher
from trainpod.api.models import LaunchOrder, RankReport, RankSlot
from trainpod.testing.wait import wait_until

SRC = Path(__file__).parents[2] / "src"


def _hold(tmp_path: Path, launcher: Launcher) -> Path:
    order = LaunchOrder(
        attempt_id=1,
        job_id=7,
        attempt_number=1,
        argv=[sys.executable, "-m", "trainpod.agent.hold"],
        workdir=str(tmp_path),
        env={"TRAINPOD_JOB_ID": "7", "PYTHONPATH": str(SRC)},
        ranks=[RankSlot(rank=0, local_rank=0)],
        log_dir=str(tmp_path / "attempt-1"),
    )
    assert launcher.launch(order)
    log = tmp_path / "attempt-1" / "rank-0.log"
    wait_until(lambda: log.exists() and "holding" in log.read_text(), what="the hold to start")
    return log


def _ended(launcher: Launcher) -> RankReport:
    def done() -> RankReport | None:
        (rep,) = launcher.reports()
        (rank,) = rep.ranks
        return rank if rank.state == "exited" else None

    return wait_until(done, timeout_s=30, what="the hold to end")


@pytest.mark.parametrize("how", ["sigterm", "sighup"])
def test_the_hold_waits_then_exits_0_when_stopped(tmp_path: Path, how: str) -> None:
    launcher = Launcher(node_env={"TRAINPOD_NODE": "n0"}, on_change=lambda: None)
    log = _hold(tmp_path, launcher)
    (rep,) = launcher.reports()
    assert rep.ranks[0].state == "running"  # it holds until told
    if how == "sigterm":
        launcher.kill(1, grace_s=30.0)  # what cancelling the allocation does
    else:
        pid = rep.ranks[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGHUP)
    rank = _ended(launcher)
    assert (rank.exit_code, rank.signal) == (0, None)
    assert "allocation 7 released on n0" in log.read_text()
