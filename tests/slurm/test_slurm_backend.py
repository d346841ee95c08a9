"""trainpod on a real Slurm: jobs through sbatch, recovery with drains, spares and requeues.

Each test creates a ``backend: slurm`` cluster against the session's Slurm (``node1..4``)
and runs ``workers/beacon_train.py`` (Gloo, beacons, checkpoints): its final ``value`` is
exact only when no step was lost or done twice across restarts.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.slurm.conftest import SlurmCI
from trainpod.agent.health import simgpu
from trainpod.api.models import ChaosRequest, JobInfo, NodeAction, NodeInfo
from trainpod.backends.slurm import SlurmBackend
from trainpod.cli.jobs import default_env
from trainpod.client.http import TrainpodClient
from trainpod.paths import ClusterPaths, read_secret
from trainpod.spec.job import JobSpec
from trainpod.spec.loading import load_cluster_spec
from trainpod.testing.wait import wait_until

TRAIN = Path(__file__).parents[1] / "integration" / "workers" / "beacon_train.py"
GOLDEN = Path(__file__).parent / "golden"
ENDED = {"completed", "failed", "cancelled"}

SPEC = """\
name: {name}
backend: slurm
instance_groups:
  - name: workers
    count: 4
    devices_per_node: 1
    slurm: {{nodes: "node[1-4]"}}
partitions:
  - {{name: debug, groups: [workers], default: true}}
  - {{name: high, groups: [workers]}}
  - {{name: low, groups: [workers]}}
preemption:
  grace_s: 15
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 5
recovery:
  teardown_grace_s: 1
"""


@dataclass
class SlurmCluster:
    paths: ClusterPaths
    backend: SlurmBackend
    client: TrainpodClient
    workdir: Path
    slurm: SlurmCI

    def submit(self, command: list[str], **kw: object) -> JobInfo:
        spec = JobSpec(command=command, env=default_env(), workdir=str(self.workdir), **kw)
        return self.client.submit(spec)

    def train(self, steps: int, **kw: object) -> JobInfo:
        cmd = [sys.executable, str(TRAIN), "--steps", str(steps), "--ckpt-every", "5"]
        return self.submit([*cmd, "--step-s", "0.1"], procs_per_node=1, **kw)

    def wait_job(self, job_id: int, states: set[str] = ENDED, timeout_s: float = 120) -> JobInfo:
        return wait_until(
            lambda: (j := self.client.job(job_id)).state in states and j,
            timeout_s=timeout_s,
            what=f"job {job_id} to reach {sorted(states)}",
        )

    def wait_step(self, job_id: int, step: int, timeout_s: float = 60) -> JobInfo:
        def reached() -> JobInfo | None:
            j = self.client.job(job_id)
            p = j.progress or {}
            return j if (p.get("last_checkpoint_step") or -1) >= step else None

        return wait_until(reached, timeout_s=timeout_s, what=f"job {job_id} checkpoint {step}")

    def slurm_job(self, external: str) -> dict[str, Any]:
        return next(j for j in self.slurm.jobs_json() if str(j["job_id"]) == external)

    def events(self, job_id: int | None = None) -> list[tuple[str, dict[str, object]]]:
        return [(e.kind, e.data) for e in self.client.events(job_id=job_id, limit=1000)]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "trainpod.cli.main", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=self.workdir,
            env={**os.environ, "COLUMNS": "200", "TRAINPOD_CLUSTER": self.paths.name},
            check=False,
        )


@pytest.fixture
def cluster(
    slurm: SlurmCI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SlurmCluster]:
    with slurm_cluster(slurm, tmp_path, monkeypatch, SPEC) as c:
        yield c


@contextlib.contextmanager
def slurm_cluster(
    slurm: SlurmCI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str
) -> Iterator[SlurmCluster]:
    """A ``backend: slurm`` cluster of ``spec`` (``{name}`` filled in) on the session's Slurm,
    deleted and the Slurm reset at the end; then none of the memory tiers its workers
    printed (``memory=DIR``) may be left in /dev/shm."""
    monkeypatch.setenv("TRAINPOD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TRAINPOD_CLUSTER", raising=False)
    monkeypatch.setenv("TRAINPOD_WARM_START", "0")  # agents come and go with each job
    spec_path = tmp_path / "cluster.yaml"
    spec_path.write_text(spec.format(name="sl"))
    paths = ClusterPaths.of("sl")
    backend = SlurmBackend(paths)
    record = backend.create(load_cluster_spec(spec_path), spec_path)
    client = TrainpodClient.for_record(record, read_secret(paths.admin_token))
    workdir = tmp_path / "work"
    workdir.mkdir()
    before = shm_entries()
    try:
        yield SlurmCluster(paths, backend, client, workdir, slurm)
    finally:
        client.close()
        reported = memory_tiers_reported(paths)  # before delete removes the logs
        backend.delete(purge=True)
        slurm.reset()
    # Nothing of this cluster stays in /dev/shm (other clusters' dirs may come and go).
    left = sorted((shm_entries() - before) & reported)
    assert not left, f"memory tiers left in {SHM}: {left}"


SHM = Path("/dev/shm/trainpod")
_MEMORY_LINE = re.compile(rf"^memory={re.escape(str(SHM))}/([^/\s]+)$", re.MULTILINE)


def shm_entries() -> set[str]:
    """The job dirs in /dev/shm/trainpod now (every cluster's on this host)."""
    try:
        return {p.name for p in SHM.iterdir()}
    except FileNotFoundError:
        return set()


def memory_tiers_reported(paths: ClusterPaths) -> set[str]:
    """The memory tier job dirs the cluster's workers printed (``memory=DIR``, as
    workers/preemptible.py does), from every rank's log of every attempt."""
    found: set[str] = set()
    for log in paths.jobs_dir.glob("*/attempt-*/rank-*.log"):
        try:
            found.update(_MEMORY_LINE.findall(log.read_text(errors="replace")))
        except OSError:
            continue
    return found


def expected_value(world: int, steps: int) -> float:
    return world * (world + 1) / 2 * steps * (steps + 1) / 2


def final_value(c: SlurmCluster, job: JobInfo) -> float:
    log = c.client.logs(job.id, rank=0, attempt=job.attempts[-1].number).data
    m = re.search(r"done steps=\d+ value=([\d.]+)", log)
    assert m, log[-2000:]
    return float(m.group(1))


# -- jobs ---------------------------------------------------------------------------------
def test_a_two_node_job_runs_through_sbatch_and_completes(cluster: SlurmCluster) -> None:
    job = cluster.train(10, nodes=2)
    assert job.external, "the job was not submitted to Slurm"
    done = cluster.wait_job(job.id)
    assert done.state == "completed", done.reason
    assert final_value(cluster, done) == expected_value(2, 10)
    ranks = {r.rank: r.node for r in done.attempts[0].ranks}
    assert set(ranks.values()) <= set(cluster.slurm.nodes) and len(set(ranks.values())) == 2
    t = cluster.slurm.timing
    sj = cluster.slurm.wait_job(
        int(job.external), frozenset({"COMPLETED"}), timeout_s=t.deadline(t.end_s)
    )
    assert sj["name"] == f"tp-sl-{job.id}"
    kinds = [k for k, _ in cluster.events(job.id)]
    assert "external_submitted" in kinds and "node_allocated" in kinds
    # Each agent's own log file, beside the job's Slurm output, has its last words.
    for node in set(ranks.values()):
        log = (cluster.paths.jobs_dir / str(job.id) / f"agent-{node}.log").read_text()
        assert "order: leave (the allocation's job ended), exit code 0" in log, log[-1500:]


def test_a_secret_env_value_reaches_the_ranks_but_not_the_batch_script(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """ADR 0032: the agents get the value in their launch orders, inside the allocation; it
    is in neither the script sbatch stored nor the job Slurm shows."""
    canary = "slurm_secret_canary_3c9d"
    show = "import hashlib, os; print('got', hashlib.sha256(os.environ['K'].encode()).hexdigest())"
    spec = JobSpec(
        command=[sys.executable, "-c", show],
        env=default_env(),
        secret_env={"K": canary},
        workdir=str(cluster.workdir),
        procs_per_node=1,
    )
    job = cluster.client.submit(spec)
    done = cluster.wait_job(job.id)
    log = cluster.client.logs(job.id, rank=0).data
    assert done.state == "completed", log
    assert f"got {hashlib.sha256(canary.encode()).hexdigest()}" in log, log
    assert job.external
    out = tmp_path / "batch.sh"
    cluster.slurm.run("scontrol", "write", "batch_script", job.external, str(out))
    script = out.read_text()
    assert "trainpod.agent.main" in script and canary not in script
    shown = cluster.slurm.run("scontrol", "show", "job", "-d", job.external, check=False)
    assert canary not in shown.stdout + shown.stderr


def test_dry_run_prints_the_batch_script(cluster: SlurmCluster) -> None:
    out = cluster.cli(
        "submit", "--dry-run", "-N", "2", "--spares", "1", "--partition", "high",
        "--time", "30:00", "--nice", "10", "--dependency", "afterok:1", "--exclude", "node4",
        "--", "python", "train.py", "--steps", "100",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout.replace(str(cluster.paths.state_dir), "$STATE").replace(
        sys.executable, "$PYTHON"
    )
    golden = GOLDEN / "sbatch-dry-run.sh"
    if os.environ.get("TRAINPOD_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text()
    assert cluster.client.jobs() == []  # nothing was submitted


def test_slurm_options_pass_through_and_pending_reasons_show(cluster: SlurmCluster) -> None:
    blocker = cluster.submit(["sleep", "30"], nodes=1, procs_per_node=1)
    waiting = cluster.submit(
        ["true"], nodes=1, procs_per_node=1, dependency=f"afterok:{blocker.external}",
        partition="high", nice=5, time_limit="5",
    )  # fmt: skip
    j = cluster.slurm_job(waiting.external)
    assert j["partition"] == "high" and j["nice"] == 5 and j["time_limit"] == 5
    info = wait_until(
        lambda: "Dependency" in (x := cluster.client.job(waiting.id)).reason and x,
        timeout_s=20,
        what="the pending reason from Slurm",
    )
    assert info.state == "queued"
    cluster.client.cancel(blocker.id)
    cluster.client.cancel(waiting.id)


def test_cancel_scancels_the_slurm_job(cluster: SlurmCluster) -> None:
    job = cluster.train(400, nodes=2)
    cluster.wait_job(job.id, {"running"}, timeout_s=60)
    cluster.client.cancel(job.id)
    done = cluster.wait_job(job.id)
    assert done.state == "cancelled"
    t = cluster.slurm.timing
    cluster.slurm.wait_job(
        int(job.external), frozenset({"CANCELLED"}), timeout_s=t.deadline(t.end_s)
    )
    # scancel ends srun with the agents: their log files still have what they said then
    logs = sorted((cluster.paths.jobs_dir / str(job.id)).glob("agent-*.log"))
    assert len(logs) == 2, logs
    for path in logs:
        wait_until(functools.partial(_said_goodbye, path), timeout_s=30, what=f"{path.name} end")


def _said_goodbye(path: Path) -> bool:
    """The agent's log has its leaving: the controller's order, or Slurm's signal."""
    text = path.read_text()
    return any(w in text for w in ("order: leave", "signal 15: stopping", "SIGTERM: asking"))


# -- recovery -----------------------------------------------------------------------------
def _node_of_rank(job: JobInfo, rank: int) -> str:
    return next(r.node for r in job.attempts[-1].ranks if r.rank == rank)


def _assert_drained(c: SlurmCluster, node: str, words: str) -> None:
    c.slurm.wait_node(node, lambda s: "DRAIN" in s.split("+"), timeout_s=30)
    reason = c.slurm.node(node)["reason"]
    assert "trainpod" in reason and words in reason, reason


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["xid79", "kill-agent"])
def test_a_node_fault_drains_the_node_and_a_spare_takes_over(
    cluster: SlurmCluster, fault: str
) -> None:
    job = cluster.train(40, nodes=2, spares=1, auto_resume=True)
    running = cluster.wait_step(job.id, 5)
    bad = _node_of_rank(running, 1)
    cluster.client.chaos(ChaosRequest(node=bad, fault=fault))
    done = cluster.wait_job(job.id, timeout_s=180)
    assert done.state == "completed", done.reason
    assert final_value(cluster, done) == expected_value(2, 40)
    assert len(done.attempts) == 2
    second = set(done.attempts[1].nodes)
    assert bad not in second and len(second) == 2
    _assert_drained(cluster, bad, "gpu" if fault == "xid79" else "heartbeat")
    decisions = [d for k, d in cluster.events(job.id) if k == "recovery_decision"]
    assert decisions and decisions[0]["action"] == "restart", decisions
    assert cluster.slurm_job(job.external)["restart_cnt"] == 0  # healed inside the allocation


@pytest.mark.timeout(300)
def test_a_killed_slurmd_is_seen_and_the_spare_takes_over(cluster: SlurmCluster) -> None:
    job = cluster.train(200, nodes=2, spares=1, auto_resume=True)
    running = cluster.wait_step(job.id, 5)
    bad = _node_of_rank(running, 1)
    cluster.slurm.kill_node(bad)  # slurmd, its stepds and its job processes: a dead node
    done = cluster.wait_job(job.id, timeout_s=240)
    assert done.state == "completed", done.reason
    assert final_value(cluster, done) == expected_value(2, 200)
    assert bad not in done.attempts[-1].nodes
    flags = cluster.slurm.node(bad)["state_flags"]
    assert "DRAIN" in flags, cluster.slurm.node(bad)


@pytest.mark.timeout(300)
def test_without_a_spare_the_job_is_requeued_without_the_bad_node(
    cluster: SlurmCluster,
) -> None:
    job = cluster.train(40, nodes=2, auto_resume=True)
    running = cluster.wait_step(job.id, 5)
    bad = _node_of_rank(running, 0)
    cluster.client.chaos(ChaosRequest(node=bad, fault="xid79"))
    done = cluster.wait_job(job.id, timeout_s=240)
    assert done.state == "completed", done.reason
    assert final_value(cluster, done) == expected_value(2, 40)
    assert bad not in done.attempts[-1].nodes
    kinds = [k for k, _ in cluster.events(job.id)]
    assert "job_requeued" in kinds, kinds
    requeued = next(d for k, d in cluster.events(job.id) if k == "job_requeued")
    assert requeued["exclude"] == [bad]
    assert cluster.slurm_job(job.external)["restart_cnt"] >= 1
    _assert_drained(cluster, bad, "gpu")
    log = cluster.client.logs(job.id, rank=0, attempt=done.attempts[-1].number).data
    assert "resuming at step" in log, log


# -- the health program -------------------------------------------------------------------
def test_the_health_program_drains_a_faulty_node(cluster: SlurmCluster) -> None:
    node = "node3"
    state = cluster.paths.node_dir(node) / "simgpu.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    # A healthy node passes (and is left alone); then its (simulated) GPU falls off the bus.
    ok = cluster.cli("health", "--slurm", "--node", node, "--cluster", "sl")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    simgpu.inject(state, "xid79")
    home = os.environ["TRAINPOD_HOME"]
    cluster.slurm.set_health_command(
        f"env TRAINPOD_HOME={home} {sys.executable} -m trainpod.cli.main health --slurm "
        "--cluster sl"
    )
    _assert_drained(cluster, node, "XID 79")
    assert "DRAIN" not in cluster.slurm.node("node2")["state_flags"]


def test_render_conf_matches_the_spec(cluster: SlurmCluster, tmp_path: Path) -> None:
    out = cluster.cli("slurm", "render-conf", "-f", str(tmp_path / "cluster.yaml"))
    assert out.returncode == 0, out.stderr
    assert "NodeName=node[1-4] Gres=gpu:1 State=UNKNOWN" in out.stdout
    assert "PartitionName=debug Nodes=node[1-4] Default=YES" in out.stdout


def test_create_refuses_a_spec_that_does_not_match_slurm(
    slurm: SlurmCI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINPOD_HOME", str(tmp_path / "home"))
    spec_path = tmp_path / "bad.yaml"
    spec_path.write_text(SPEC.format(name="bad").replace("node[1-4]", "node[1-3],gpu9"))
    out = subprocess.run(
        [sys.executable, "-m", "trainpod.cli.main", "cluster", "create", "-f", str(spec_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "'gpu9' is not a Slurm node" in out.stderr, out.stderr
    assert not ClusterPaths.of("bad").record.exists()


Maker = Callable[..., SlurmCluster]


@pytest.mark.timeout(300)
def test_a_node_that_passes_the_deep_check_is_resumed_in_slurm(cluster: SlurmCluster) -> None:
    """XID 79 → drained; checks in place fail while the GPU is bad (retired); once it is
    fixed, an operator's resume runs the deep check on the node's live agent (inside the
    job's allocation) and resumes the node in Slurm."""
    job = cluster.train(400, nodes=2, spares=1, auto_resume=True)
    running = cluster.wait_step(job.id, 5)
    bad = _node_of_rank(running, 1)
    cluster.client.chaos(ChaosRequest(node=bad, fault="xid79"))
    _assert_drained(cluster, bad, "gpu")
    retired = wait_until(
        lambda: (n := _trainpod_node(cluster, bad)).state == "retired" and n,
        timeout_s=90,
        what=f"the in-place checks of {bad} to fail while its GPU is bad",
    )
    assert retired.repairs >= 3 and "XID 79" in retired.reason, retired
    assert "DRAIN" in cluster.slurm.node(bad)["state_flags"]
    simgpu.clear(cluster.paths.node_dir(bad) / "simgpu.json")  # the GPU is replaced
    cluster.client.node_action(bad, NodeAction(action="resume", reason="GPU replaced"))
    wait_until(
        lambda: _trainpod_node(cluster, bad).state == "idle",
        timeout_s=90,
        what=f"{bad} to pass its deep check",
    )
    # trainpod resumes the node in Slurm as it marks it idle: one RPC, then slurmctld's ping.
    t = cluster.slurm.timing
    cluster.slurm.wait_node(bad, lambda s: "+" not in s, timeout_s=t.deadline(t.rpc_s, t.respond_s))
    kinds = [k for k, _ in cluster.events()]
    assert "deep_check_finished" in kinds and "node_repaired" in kinds, kinds
    cluster.client.cancel(job.id)


def _trainpod_node(c: SlurmCluster, name: str) -> NodeInfo:
    return next(n for n in c.client.nodes() if n.name == name)


@pytest.mark.timeout(120)
def test_alloc_runs_the_job_under_salloc_in_the_foreground(cluster: SlurmCluster) -> None:
    code = "import os; print('hello from rank', os.environ['RANK'], os.environ['TRAINPOD_NODE'])"
    out = cluster.cli("alloc", "-N", "2", "-p", "1", "--", sys.executable, "-c", code)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "hello from rank 0 node" in out.stdout and "completed" in out.stdout
    (job,) = cluster.client.jobs()
    assert job.state == "completed" and job.spec.interactive and job.external
    t = cluster.slurm.timing
    cluster.slurm.wait_job(
        int(job.external), frozenset({"COMPLETED"}), timeout_s=t.deadline(t.end_s)
    )  # the salloc allocation ended


@pytest.mark.timeout(120)
def test_jobs_get_whole_nodes_so_two_small_jobs_run_side_by_side(cluster: SlurmCluster) -> None:
    jobs = [cluster.train(10, nodes=1) for _ in range(3)]
    done = [cluster.wait_job(j.id) for j in jobs]
    assert [d.state for d in done] == ["completed"] * 3, [d.reason for d in done]
    for d in done:
        assert final_value(cluster, d) == expected_value(1, 10)
