"""An agent inside a Slurm allocation: the batch trap's notice file becomes trainpod's notice
to the ranks running there (the notice file and signal of a preempted attempt's kill order)."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from trainpod.agent.launcher import Launcher, Notice, notice_file
from trainpod.agent.slurmnotice import SlurmNoticeWatch
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
    watch = SlurmNoticeWatch(
        path,
        Notice(signal.SIGUSR1, 30.0, "preempted by Slurm"),
        launcher,
        teardown_grace_s=1.0,
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
