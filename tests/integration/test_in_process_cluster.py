"""An in-process-recovery job on a real local cluster (2 nodes x 2 Gloo ranks, on CPU).

The controller's rung (ADR 0026): a killed rank of an opted-in job is started again in the
same attempt, the three healthy ranks keep their processes, and the job ends with the
model of an undisturbed run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Cluster
from trainpod.api.models import ChaosRequest
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
WORKER = Path(__file__).parent / "workers" / "elastic_dp.py"
STEPS = 150


def _results(out: Path) -> dict[int, dict[str, Any]]:
    return {r: json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)}


def _undisturbed(cluster: Cluster, tmp_path: Path) -> dict[int, dict[str, Any]]:
    """The same job run without a fault: what a recovered run must end with, bit for bit."""
    reference = tmp_path / "reference"
    reference.mkdir()
    argv = ["python", str(WORKER), "--steps", str(STEPS), "--out", str(reference)]
    ref_job = cluster.submit(argv, nodes=2, procs_per_node=2)
    done = cluster.wait_job(ref_job.id, timeout_s=120)
    assert done.state == "completed", cluster.describe(done)
    cluster.wait_idle()
    return _results(reference)


@pytest.mark.timeout(300)
def test_a_killed_rank_is_recovered_in_process(cluster: Cluster, tmp_path: Path) -> None:
    undisturbed = _undisturbed(cluster, tmp_path)

    out = tmp_path / "out"
    out.mkdir()
    argv = ["python", str(WORKER), "--steps", str(STEPS), "--out", str(out)]
    argv += ["--mark-at", "5", "--step-sleep", "0.1", "--wait-s", "120"]
    job = cluster.submit(argv, nodes=2, procs_per_node=2, auto_resume=True, recovery="in-process")
    assert cluster.client.job(job.id).spec.recovery == "in-process"
    wait_until(
        lambda: all((out / f"at-5-rank-{r}").exists() for r in range(4)),
        timeout_s=90,
        what="every rank past step 5",
    )
    (attempt,) = cluster.client.job(job.id).attempts
    pids = {r.rank: r.pid for r in attempt.ranks}
    # 145 steps of 0.1 s are left: the kill lands long before the attempt could end
    cluster.client.chaos(ChaosRequest(node="workers-1", fault="kill-worker", rank=3))
    done = cluster.wait_job(job.id, timeout_s=180)
    assert done.state == "completed", cluster.describe(done)
    (same,) = done.attempts  # no second attempt: the first one was kept
    assert same.number == attempt.number == 1
    assert all(r.exit_code == 0 for r in same.ranks)

    events = cluster.client.events(job_id=job.id)
    kinds = [e.kind for e in events]
    assert "recovery_decision" not in kinds and "fault_detected" not in kinds
    (started,) = [e for e in events if e.kind == "in_process_recovery_started"]
    (recovered,) = [e for e in events if e.kind == "in_process_recovery_done"]
    assert (started.data["rank"], started.data["generation"], started.data["replaced"]) == (
        3,
        1,
        [3],
    )
    assert recovered.data["generation"] == 1 and recovered.data["duration_s"] > 0

    results = _results(out)
    assert {r: results[r]["pid"] for r in (0, 1, 2)} == {r: pids[r] for r in (0, 1, 2)}
    assert results[3]["pid"] != pids[3]  # the killed rank is a new process
    assert {r["steps"] for r in results.values()} == {STEPS}
    assert {r["generation"] for r in results.values()} == {1}
    for r in range(4):  # the model of the undisturbed run, bit for bit
        assert results[r]["final_loss"] == undisturbed[r]["final_loss"]
        assert results[r]["params"] == undisturbed[r]["params"]
    # every rank was told where its node's recover file is: the job's scratch dir there
    files = [results[r]["recover_file"] for r in range(4)]
    assert all(f.endswith(f"job-{job.id}/recover.json") for f in files), files
    assert files[0] == files[1] != files[2] == files[3]
    cluster.wait_idle()


@pytest.mark.timeout(300)
def test_a_hung_rank_is_replaced_in_process(cluster: Cluster, tmp_path: Path) -> None:
    """A rank that stops (SIGSTOP: alive, silent) is told apart from its peers by what they
    say once their collective times out (they lost their group); it alone is started again,
    in the same attempt, and the model is the undisturbed run's. The job's hang timeout is
    the default (minutes): the peers' word, after their 2 s collective timeout, is what
    starts the recovery."""
    undisturbed = _undisturbed(cluster, tmp_path)

    out = tmp_path / "out"
    out.mkdir()
    argv = ["python", str(WORKER), "--steps", str(STEPS), "--out", str(out), "--beacon"]
    argv += ["--mark-at", "5", "--step-sleep", "0.1", "--wait-s", "120", "--timeout-s", "2"]
    job = cluster.submit(
        argv,
        nodes=2,
        procs_per_node=2,
        auto_resume=True,
        recovery="in-process",
    )
    wait_until(
        lambda: all((out / f"at-5-rank-{r}").exists() for r in range(4)),
        timeout_s=90,
        what="every rank past step 5",
    )
    (attempt,) = cluster.client.job(job.id).attempts
    pids = {r.rank: r.pid for r in attempt.ranks}
    cluster.client.chaos(ChaosRequest(node="workers-1", fault="hang", rank=3))
    done = cluster.wait_job(job.id, timeout_s=180)
    assert done.state == "completed", cluster.describe(done)
    (same,) = done.attempts  # no second attempt: the first one was kept
    assert all(r.exit_code == 0 for r in same.ranks), cluster.describe(done)

    events = cluster.client.events(job_id=job.id)
    kinds = [e.kind for e in events]
    assert "in_process_recovery_abandoned" not in kinds, kinds
    (started,) = [e for e in events if e.kind == "in_process_recovery_started"]
    (recovered,) = [e for e in events if e.kind == "in_process_recovery_done"]
    assert (started.data["rank"], started.data["generation"], started.data["replaced"]) == (
        3,
        1,
        [3],
    )
    reason = started.data["reason"]
    assert reason.startswith("rank 0, 1, 2 lost its process group of generation 0"), reason
    assert "rank 3 stayed silent while the others lost their group" in reason
    assert recovered.data["generation"] == 1 and recovered.data["duration_s"] > 0

    results = _results(out)
    assert {r: results[r]["pid"] for r in (0, 1, 2)} == {r: pids[r] for r in (0, 1, 2)}
    assert results[3]["pid"] != pids[3]  # the stopped rank was killed and started again
    assert {r["steps"] for r in results.values()} == {STEPS}
    assert {r["generation"] for r in results.values()} == {1}
    causes = {rec["cause"] for r in (0, 1, 2) for rec in results[r]["recoveries"]}
    assert causes, results[0]["recoveries"]  # the healthy ranks saw their group fail
    for r in range(4):  # the model of the undisturbed run, bit for bit
        assert results[r]["final_loss"] == undisturbed[r]["final_loss"]
        assert results[r]["params"] == undisturbed[r]["params"]
    cluster.wait_idle()
