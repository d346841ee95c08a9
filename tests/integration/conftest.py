"""A real local cluster per test: real processes, real SQLite, real ports."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from trainpod.api.models import JobInfo
from trainpod.backends.local import LocalBackend
from trainpod.cli.jobs import default_env
from trainpod.client.http import TrainpodClient
from trainpod.paths import ClusterPaths, ClusterRecord, read_secret
from trainpod.spec.job import JobSpec
from trainpod.spec.loading import load_cluster_spec
from trainpod.testing.wait import wait_until

ENDED = {"completed", "failed", "cancelled"}

SPEC = """\
name: {name}
backend: local
instance_groups:
  - name: workers
    count: {workers}
    devices_per_node: 2
    lifecycle: {lifecycle}
  - name: spares
    count: 1
    devices_per_node: 2
    spare: true
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 5
recovery:
  teardown_grace_s: 2
"""


@dataclass
class Cluster:
    paths: ClusterPaths
    record: ClusterRecord
    backend: LocalBackend
    client: TrainpodClient
    workdir: Path

    def submit(self, command: list[str], **kw: object) -> JobInfo:
        spec = JobSpec(command=command, env=default_env(), workdir=str(self.workdir), **kw)
        return self.client.submit(spec)

    def wait_job(self, job_id: int, states: set[str] = ENDED, timeout_s: float = 90) -> JobInfo:
        return wait_until(
            lambda: (j := self.client.job(job_id)).state in states and j,
            timeout_s=timeout_s,
            what=f"job {job_id} to reach {sorted(states)}",
        )

    def wait_idle(self, timeout_s: float = 60) -> None:
        wait_until(
            lambda: all(n.state == "idle" for n in self.client.nodes()),
            timeout_s=timeout_s,
            what="every node idle",
        )

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the real ``trainpod`` CLI against this cluster."""
        return subprocess.run(
            [sys.executable, "-m", "trainpod.cli.main", *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=120,
            cwd=self.workdir,
            env={**os.environ, "COLUMNS": "200", "TRAINPOD_CLUSTER": self.paths.name},
        )


def _bring_up(spec_path: Path, name: str, tmp_path: Path, made: list[Cluster]) -> Cluster:
    """Create the cluster of ``spec_path`` and wait until its nodes have set up."""
    paths = ClusterPaths.of(name)
    backend = LocalBackend(paths)
    record = backend.create(load_cluster_spec(spec_path), spec_path)
    client = TrainpodClient(record.url, read_secret(paths.admin_token))
    workdir = tmp_path / f"work-{name}"
    workdir.mkdir()
    c = Cluster(paths, record, backend, client, workdir)
    made.append(c)
    wait_until(
        lambda: all(n.state in ("idle", "failed") for n in client.nodes()),
        timeout_s=60,
        what="nodes to finish setting up",
    )
    return c


def _tear_down(made: list[Cluster]) -> None:
    for c in made:
        c.client.close()
        if c.paths.record.exists():  # a test may have deleted it already
            c.backend.delete(purge=True)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("TRAINPOD_HOME", str(h))
    monkeypatch.delenv("TRAINPOD_CLUSTER", raising=False)
    return h


@pytest.fixture
def make_cluster(home: Path, tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(name: str = "t", workers: int = 2, lifecycle: str = "[]", extra: str = "") -> Cluster:
        spec_path = tmp_path / f"{name}.yaml"
        spec_path.write_text(
            SPEC.format(name=name, workers=workers, lifecycle=lifecycle) + textwrap.dedent(extra)
        )
        return _bring_up(spec_path, name, tmp_path, made)

    yield make
    _tear_down(made)


@pytest.fixture
def cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    return make_cluster()


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie, or a process reaped while we look, does not.

    Reading ``/proc/PID/stat`` by hand raced the reaper (ESRCH, ProcessLookupError, while the
    kernel tore the entry down); psutil turns every such case into NoSuchProcess.
    """
    if not psutil.pid_exists(pid):
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # ZombieProcess is a NoSuchProcess too
        return False


@pytest.fixture
def make_cluster_from_spec(home: Path, tmp_path: Path) -> Iterator[Callable[[str], Cluster]]:
    """Like ``make_cluster``, for a whole spec of the test's own (``{name}`` is filled in)."""
    made: list[Cluster] = []

    def make(spec_text: str, name: str = "t") -> Cluster:
        spec_path = tmp_path / f"{name}.yaml"
        spec_path.write_text(textwrap.dedent(spec_text).format(name=name))
        return _bring_up(spec_path, name, tmp_path, made)

    yield make
    _tear_down(made)
