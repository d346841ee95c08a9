"""A node's lifecycle scripts: in order, a log each, and a timeout that stops the script's
whole process group (SIGTERM first, SIGKILL after a grace)."""

from __future__ import annotations

import time
from pathlib import Path

import psutil

from trainpod.agent.lifecycle import KILL_GRACE_S, LifecycleRunner, Script
from trainpod.testing.wait import wait_until


def _runner(tmp_path: Path, *scripts: Script) -> LifecycleRunner:
    return LifecycleRunner(
        scripts, log_dir=tmp_path / "logs", marker=tmp_path / "done", env={}, on_change=lambda: None
    )


def test_scripts_run_in_order_and_the_node_remembers_they_did(tmp_path: Path) -> None:
    for name, body in (("a.sh", "echo one"), ("b.sh", "echo two")):
        (tmp_path / name).write_text(body + "\n")
    scripts = [Script(tmp_path / "a.sh", 30), Script(tmp_path / "b.sh", 30)]
    r = _runner(tmp_path, *scripts)
    r.run()
    assert r.state == "ok" and [x.state for x in r.results] == ["ok", "ok"]
    assert r.results[1].tail.endswith("two")
    assert _runner(tmp_path, *scripts).state == "ok"  # a restarted agent does not run them again


def test_a_script_past_its_timeout_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    # The script starts a child in its process group, then waits for it past the timeout.
    (tmp_path / "slow.sh").write_text(f"sleep 60 & echo $! > {pid_file}\nwait\n")
    r = _runner(tmp_path, Script(tmp_path / "slow.sh", 0.5))
    t0 = time.monotonic()
    r.run()
    assert time.monotonic() - t0 < KILL_GRACE_S  # both heeded SIGTERM: no wait for the grace
    (result,) = r.results
    assert r.state == "failed" and result.state == "timeout"
    assert "killed after the timeout" in Path(result.log_path or "").read_text()
    child = int(pid_file.read_text())

    def gone() -> bool:
        try:
            return psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(gone, timeout_s=10, what="the script's child to be stopped with it")
