"""The local backend: create, lifecycle scripts, stop/start, delete, two clusters side by side."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import Cluster, pid_alive
from trainpod.backends.procs import read_pid
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + body)
    path.chmod(0o755)
    return path


def test_create_gives_every_node_an_agent_scratch_and_identity(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    script = _script(
        tmp_path / "whoami.sh",
        'echo "node=$TRAINPOD_NODE group=$TRAINPOD_GROUP role=$TRAINPOD_ROLE"\n'
        'touch "$TRAINPOD_SCRATCH_DIR/setup-done" "$TRAINPOD_SHARED_DIR/$TRAINPOD_NODE"\n',
    )
    c = make_cluster(lifecycle=f"[{{script: {script}, timeout_s: 30}}]")
    nodes = {n.name: n for n in c.client.nodes()}
    assert set(nodes) == {"workers-0", "workers-1", "spares-0"}
    assert all(n.state == "idle" for n in nodes.values())
    assert nodes["spares-0"].spare
    assert nodes["workers-0"].facts["devices"] == {
        "kind": "cpu",
        "count": 2,
        "visible": [],
        "simulated": True,
    }
    pids = {n.agent_pid for n in nodes.values()}
    assert len(pids) == 3 and all(p and pid_alive(p) for p in pids)
    for name in ("workers-0", "workers-1"):  # the spec gives scripts to the workers group
        scratch = Path(c.record.scratch_root) / name
        assert (scratch / "setup-done").exists()
        assert (Path(c.record.shared_dir) / name).exists()
        log = c.paths.node_dir(name) / "lifecycle" / "00-whoami.sh.log"
        assert f"node={name} group={name.rsplit('-', 1)[0]} role=compute" in log.read_text()
    # the admin token is private
    mode = stat.S_IMODE(os.stat(c.paths.admin_token).st_mode)
    assert mode == 0o600
    out = c.cli("cluster", "describe", "t")
    assert "controller" in out.stdout and "workers-1" in out.stdout
    assert "t " in c.cli("cluster", "list").stdout


def test_failing_and_hanging_lifecycle_scripts_fail_the_node(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    bad = _script(
        tmp_path / "install.sh",
        'if [ "$TRAINPOD_NODE" = workers-1 ]; then echo "apt: package foo not found" >&2; '
        "exit 4; fi\n"
        'if [ "$TRAINPOD_NODE" = workers-0 ]; then sleep 60; fi\n',
    )
    c = make_cluster(lifecycle=f"[{{script: {bad}, timeout_s: 2}}]")
    nodes = {n.name: n for n in c.client.nodes()}
    assert nodes["workers-0"].state == "failed"
    assert "timed out after 2.0s" in nodes["workers-0"].reason
    assert nodes["workers-1"].state == "failed"
    assert "install.sh exited with code 4" in nodes["workers-1"].reason
    assert "apt: package foo not found" in nodes["workers-1"].reason
    assert nodes["spares-0"].state == "idle"  # the spares group has no scripts
    out = c.cli("nodes").stdout
    assert "failed" in out and "apt: package foo not found" in out
    assert "apt: package foo not found" in c.cli("cluster", "describe").stdout
    # a job cannot land on a failed node: it waits in the queue
    job = c.submit(["true"], nodes=1, procs_per_node=1)
    assert c.client.job(job.id).state == "queued"
    events = [e.kind for e in c.client.events(node="workers-1")]
    assert "node_state" in events


def test_stop_and_start_keep_state_and_skip_finished_lifecycle(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    counter = tmp_path / "runs"
    script = _script(tmp_path / "count.sh", f'echo "$TRAINPOD_NODE" >> {counter}\n')
    c = make_cluster(lifecycle=f"[{{script: {script}}}]")
    job = c.submit(["true"])
    assert c.wait_job(job.id).state == "completed"
    pids = [p.pid for p in c.backend.processes()]
    stopped = c.backend.stop()
    assert "controller" in stopped and "agent-workers-0" in stopped
    alive = [(p, psutil.Process(p).cmdline()) for p in pids if p and pid_alive(p)]
    assert not alive
    assert not any(p.alive for p in c.backend.processes())
    c.backend.start()
    c.wait_idle()
    assert c.client.job(job.id).state == "completed"  # state survived
    assert len(counter.read_text().split()) == 2  # lifecycle scripts did not run again
    again = c.submit(["true"])
    assert c.wait_job(again.id).state == "completed"


def test_two_clusters_on_one_machine_do_not_collide(
    make_cluster: Callable[..., Cluster],
) -> None:
    a = make_cluster("alpha", workers=1)
    b = make_cluster("beta", workers=1)
    assert a.record.port != b.record.port
    assert a.paths.state_dir != b.paths.state_dir
    assert a.record.shared_dir != b.record.shared_dir
    ja, jb = a.submit(["true"]), b.submit(["true"])
    assert a.wait_job(ja.id).state == "completed"
    assert b.wait_job(jb.id).state == "completed"
    a.backend.delete(purge=False)
    assert Path(a.record.shared_dir).exists()  # kept without --purge
    assert not a.paths.state_dir.exists()
    assert all(p.alive for p in b.backend.processes())  # only alpha's processes were stopped
    out = b.cli(
        "cluster", "create", "-f", str(a.record.spec_path).replace("alpha", "beta"), check=False
    )
    assert out.returncode == 2 and "already exists" in out.stderr


def test_controller_pid_file_and_logs(cluster: Cluster) -> None:
    pid = read_pid(cluster.paths.pid_file("controller"))
    assert pid and pid_alive(pid)
    assert cluster.client.cluster().controller_pid == pid
    wait_until(lambda: cluster.paths.log_file("controller").read_text(), what="controller log")
