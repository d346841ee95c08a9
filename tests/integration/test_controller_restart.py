"""``kill -9`` of the controller while a job runs: nothing is lost."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster, pid_alive
from trainpod.backends.procs import read_pid
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
WORKERS = Path(__file__).parent / "workers"


def test_kill_9_controller_mid_job_then_restart(cluster: Cluster, tmp_path: Path) -> None:
    d = tmp_path / "hold"
    d.mkdir()
    job = cluster.submit(["python", str(WORKERS / "hold.py"), str(d)], nodes=2, procs_per_node=2)
    wait_until(lambda: cluster.client.job(job.id).state == "running", what="job running")
    wait_until(lambda: len(list(d.glob("pid-*"))) == 4, what="4 ranks up")
    before = cluster.client.events()
    worker_pids = [int(p.read_text()) for p in d.glob("pid-*")]
    assert len(worker_pids) == 4

    pid = read_pid(cluster.paths.pid_file("controller"))
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), timeout_s=10, what="controller dead")
    # while the controller is away, workers keep running and then finish
    assert all(pid_alive(p) for p in worker_pids)
    (d / "release").touch()
    wait_until(lambda: not any(pid_alive(p) for p in worker_pids), what="ranks to finish")

    assert cluster.backend.start() == ["controller"]  # agents were still up
    done = cluster.wait_job(job.id)
    assert done.state == "completed", done.reason
    assert [r.exit_code for r in done.attempts[0].ranks] == [0, 0, 0, 0]
    cluster.wait_idle()
    # Idle nodes were idle in the store already: wait for every agent's next heartbeat.
    wait_until(
        lambda: [e.kind for e in cluster.client.events()].count("agent_reconnected") == 3,
        what="all three agents to reconnect",
    )

    after = cluster.client.events()
    assert [e.model_dump() for e in after[: len(before)]] == [e.model_dump() for e in before]
    ids = [e.id for e in after]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    kinds = [e.kind for e in after[len(before) :]]
    assert "controller_started" in kinds
    assert kinds.count("agent_reconnected") == 3
    job_events = [e for e in after if e.job_id == job.id]
    assert sum(e.kind == "rank_exited" for e in job_events) == 4
    assert any(e.kind == "job_state" and e.data["new"] == "completed" for e in job_events)


def test_agents_keep_reporting_after_controller_restart(cluster: Cluster) -> None:
    pid = read_pid(cluster.paths.pid_file("controller"))
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), timeout_s=10, what="controller dead")
    cluster.backend.start()
    job = cluster.submit(["true"], nodes=2, procs_per_node=1)
    assert cluster.wait_job(job.id).state == "completed"
