"""A real local cluster per test: real processes, real SQLite, real ports."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from trainpod.api.models import AttemptInfo, JobInfo
from trainpod.backends.local import LocalBackend
from trainpod.cli.jobs import default_env
from trainpod.client.http import TrainpodClient
from trainpod.paths import ClusterPaths, ClusterRecord, read_secret
from trainpod.spec.job import JobSpec
from trainpod.spec.loading import load_cluster_spec
from trainpod.testing.wait import WaitTimeout, wait_until

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
  exit_wait_s: {exit_wait_s}
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
        """The job once it is in one of ``states``; on a timeout, an error that says where the
        job and the nodes stood (its reason and attempts, every node's state)."""
        seen: list[JobInfo] = []

        def probe() -> JobInfo | None:
            j = self.client.job(job_id)
            seen[:] = [j]
            return j if j.state in states else None

        try:
            what = f"job {job_id} to reach {sorted(states)}"
            return wait_until(probe, timeout_s=timeout_s, what=what)
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc}\n{self.describe(seen[0] if seen else None)}") from None

    def describe(self, job: JobInfo | None = None) -> str:
        """Where the cluster stands, for a failing test's message."""
        lines = []
        if job is not None:
            attempts = [(a.number, a.state.value, a.nodes, a.cause) for a in job.attempts]
            lines.append(f"job {job.id}: {job.state.value} ({job.reason}); attempts {attempts}")
            if job.attempts:
                lines += self._ranks_of(job.id, job.attempts[-1])
        for n in self.client.nodes():
            lines.append(f"node {n.name}: {n.state.value} ({n.reason}) job={n.job_id}")
        return "\n".join(lines)

    def _ranks_of(self, job_id: int, attempt: AttemptInfo, tail: int = 12) -> list[str]:
        """Each rank of ``attempt``: its state, where a live one waits (``/proc``), and the
        end of its log; what a hang needs to be told apart (in the step, or at exit)."""
        out = []
        for r in attempt.ranks:
            ended = f"code={r.exit_code} signal={r.signal}"
            head = f"  rank {r.rank} pid {r.pid}: {r.state.value} {ended}"
            if r.pid is not None and r.state.value == "running":
                head += f"; {_proc_state(r.pid)}"
            out.append(head)
            try:
                text = self.client.logs(job_id, rank=r.rank, attempt=attempt.number).data
            except Exception as exc:  # a message for a failing test: never fail it here
                text = f"(log not read: {exc})"
            out += [f"    | {line}" for line in text.splitlines()[-tail:]]
        return out

    def log_tails(self, lines: int = 40) -> str:
        """The last lines of each of the cluster's process logs (controller, agents)."""
        out = []
        logs = [*self.paths.logs.glob("*.log"), *self.paths.state_dir.glob("nodes/*/agent.log")]
        for log in sorted(logs):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            name = log.relative_to(self.paths.state_dir)
            out.append(f"--- {name} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(out)

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
    client = TrainpodClient.for_record(record, read_secret(paths.admin_token))
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


def _tear_down(made: list[Cluster], request: pytest.FixtureRequest) -> None:
    if _failed(request):  # printed here, pytest shows it under the failing test's report
        for c in made:
            try:
                print(f"=== cluster {c.paths.name}\n{c.describe()}")
            except Exception as exc:  # the controller may be what broke
                print(f"=== cluster {c.paths.name}: no answer ({exc})")
            print(c.log_tails())
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
def make_cluster(
    home: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(
        name: str = "t",
        workers: int = 2,
        lifecycle: str = "[]",
        extra: str = "",
        exit_wait_s: float = 60.0,
    ) -> Cluster:
        spec_path = tmp_path / f"{name}.yaml"
        text = SPEC.format(name=name, workers=workers, lifecycle=lifecycle, exit_wait_s=exit_wait_s)
        spec_path.write_text(text + textwrap.dedent(extra))
        return _bring_up(spec_path, name, tmp_path, made)

    yield make
    _tear_down(made, request)


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
def make_cluster_from_spec(
    home: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[[str], Cluster]]:
    """Like ``make_cluster``, for a whole spec of the test's own (``{name}`` is filled in)."""
    made: list[Cluster] = []

    def make(spec_text: str, name: str = "t") -> Cluster:
        spec_path = tmp_path / f"{name}.yaml"
        spec_path.write_text(textwrap.dedent(spec_text).format(name=name))
        return _bring_up(spec_path, name, tmp_path, made)

    yield make
    _tear_down(made, request)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the test item, so a fixture's tear-down knows whether the
    test failed (and prints the cluster's logs only then)."""
    report = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    return report


_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


def _failed(request: pytest.FixtureRequest) -> bool:
    reports = request.node.stash.get(_REPORTS, {})
    return any(r.failed for r in reports.values())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A cluster test without its own timeout gets 150 s: above the waits inside it (a job's
    90 s), so a stuck test fails with the wait's message (where the job and nodes stood)
    and the cluster's logs, not with a bare timeout from pytest-timeout."""
    for item in items:
        if item.get_closest_marker("timeout") is None and "integration" in item.path.parts:
            item.add_marker(pytest.mark.timeout(150))


def _proc_state(pid: int) -> str:
    """A live process's state as the kernel sees it: state, wait channel, threads."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
    except OSError as exc:
        return f"/proc unreadable ({exc.strerror})"
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    state, threads = fields.get("State", "?").strip(), fields.get("Threads", "?").strip()
    return f"{state}, waiting in {wchan}, {threads} threads"
