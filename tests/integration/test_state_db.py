"""The controller's database under faults (ADR 0034): a corrupted file refused at start and
restored from `trainpod cluster backup`; a lock held by another process; a full disk."""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from trainpod.cli import cluster as cluster_cli
from trainpod.errors import Fatal, StoreUnavailable
from trainpod.paths import ClusterPaths
from trainpod.store.backup import check
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration

# Two nodes; a short busy timeout (the lock test's refusal comes within a second);
# heartbeats that may pause for a while (a full disk) without a node being declared lost.
SPEC = """\
name: {name}
backend: local
instance_groups:
  - name: workers
    count: 2
    devices_per_node: 1
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 60
storage:
  state_db_busy_timeout_s: 0.5
"""


@pytest.mark.timeout(240)
def test_corrupt_database_refused_then_restored(
    make_cluster_from_spec: Callable[[str], Cluster], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = make_cluster_from_spec(SPEC)
    jobs = [cluster.submit(["true"], nodes=1) for _ in range(2)]
    for j in jobs:
        assert cluster.wait_job(j.id).state == "completed"
    # The CLI's commands, called in this process (a `trainpod` subprocess costs ~10 s of
    # imports on a loaded box; the lock test runs the real `trainpod cluster backup` once).
    cluster_cli.backup(name=cluster.paths.name, to=None)
    assert "integrityok" in _joined(capsys.readouterr().out)
    (backup,) = cluster.paths.backups.glob("controller-*.db")
    with pytest.raises(Fatal, match="is running"):
        cluster_cli.restore(name=cluster.paths.name, from_=None)

    cluster.backend.stop()
    with cluster.paths.db.open("r+b") as f:  # the header and the first page's start
        f.write(b"\xde\xad\xbe\xef" * 64)
    with pytest.raises(Fatal) as err:
        cluster.backend.start()
    message = str(err.value)
    assert str(cluster.paths.db) in message
    assert "PRAGMA quick_check" in message
    assert f"trainpod cluster restore {cluster.paths.name}" in message

    cluster_cli.restore(name=cluster.paths.name, from_=None)
    out = _joined(capsys.readouterr().out)  # rich folds long paths at its 80 columns
    assert backup.name in out and "integrityok" in out, out
    assert check(cluster.paths.db).ok
    restored_to = cluster_last_event(cluster)
    cluster.backend.start()
    # The backup's nodes name the agents that ran then: wait for the new ones to be known.
    wait_until(
        lambda: agents_since(cluster, restored_to) == {n.name for n in cluster.client.nodes()},
        what="every node's new agent registered",
    )
    for j in jobs:
        assert cluster.client.job(j.id).state == "completed"
    after = cluster.submit(["true"], nodes=1)
    assert after.id == jobs[-1].id + 1
    done = cluster.wait_job(after.id)
    assert done.state == "completed", done.reason


def _joined(text: str) -> str:
    return "".join(text.split())


def cluster_last_event(cluster: Cluster) -> int:
    with sqlite3.connect(cluster.paths.db) as conn:
        return int(conn.execute("SELECT MAX(id) FROM events").fetchone()[0])


def agents_since(cluster: Cluster, event_id: int) -> set[str]:
    kinds = {"agent_registered", "agent_reconnected"}
    return {e.node or "" for e in cluster.client.events() if e.id > event_id and e.kind in kinds}


def test_database_locked_by_another_process(
    make_cluster_from_spec: Callable[[str], Cluster],
) -> None:
    cluster = make_cluster_from_spec(SPEC)
    first = cluster.submit(["true"], nodes=1)
    other = sqlite3.connect(cluster.paths.db, isolation_level=None, timeout=10)
    other.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreUnavailable) as err:
            cluster.submit(["true"], nodes=1)
        assert "(503)" in str(err.value) and "locked by another process" in str(err.value)
        assert cluster.client.job(first.id).id == first.id  # reads go on (WAL)
    finally:
        other.execute("ROLLBACK")
        other.close()
    second = cluster.submit(["true"], nodes=1)
    assert second.id == first.id + 1  # the refused call left nothing behind
    for j in (first, second):
        assert cluster.wait_job(j.id).state == "completed"
    assert check(cluster.paths.db).ok
    copy = cluster.workdir / "copy.db"  # the real CLI, while the controller runs
    out = cluster.cli("cluster", "backup", "--to", str(copy)).stdout
    assert "integrity ok" in out and check(copy).ok, out


@pytest.fixture
def tmpfs_state_dir(home: Path) -> Iterator[ClusterPaths]:
    """The state dir of cluster ``t`` on a 16 MiB tmpfs, unmounted at the end (the test
    stops the cluster first: a mounted dir with open files cannot be unmounted)."""
    paths = ClusterPaths.of("t")
    paths.state_dir.mkdir(parents=True)
    mount = ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(paths.state_dir)]
    done = subprocess.run(mount, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield paths
    finally:
        subprocess.run(["umount", "-l", str(paths.state_dir)], check=False)


def _fill(directory: Path) -> Path:
    """Write one file until the file system is full; its path (unlink it to free the room)."""
    filler = directory / "filler"
    chunk = b"\0" * (1 << 16)
    # Unbuffered: a buffered file would raise ENOSPC again on close, flushing what is left.
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


@pytest.mark.timeout(180)
def test_state_dir_full(
    tmpfs_state_dir: ClusterPaths, make_cluster_from_spec: Callable[[str], Cluster]
) -> None:
    cluster = make_cluster_from_spec(SPEC)
    try:
        accepted = [cluster.submit(["true"], nodes=1).id]
        assert cluster.wait_job(accepted[0]).state == "completed"
        filler = _fill(tmpfs_state_dir.state_dir)
        refusals: list[str] = []

        def refused() -> bool:
            """Submit until one is refused: SQLite fills the room its log already has first."""
            try:
                accepted.append(cluster.submit(["true"], nodes=1, name="while-full").id)
            except StoreUnavailable as exc:
                refusals.append(str(exc))
                return True
            return False

        wait_until(refused, timeout_s=60, what="a submission refused for the full disk")
        assert "(503)" in refusals[0] and "disk full" in refusals[0], refusals[0]
        assert "free space and retry" in refusals[0]
        os.unlink(filler)

        def back() -> bool:
            try:
                accepted.append(cluster.submit(["true"], nodes=1, name="after").id)
            except StoreUnavailable:
                return False
            return True

        wait_until(back, timeout_s=30, what="submissions accepted again")
        assert cluster.wait_job(accepted[-1]).state == "completed"
        for job_id in accepted:  # every accepted job is in the store
            assert cluster.client.job(job_id).id == job_id
        listed = {j.id for j in cluster.client.jobs()}
        assert set(accepted) <= listed
        ids = [e.id for e in cluster.client.events()]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        assert check(cluster.paths.db).ok
    finally:
        cluster.backend.stop()
