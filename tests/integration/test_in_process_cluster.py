"""An in-process-recovery job on a real local cluster (2 nodes x 2 Gloo ranks).

The controller's in-process rung is not built yet (ADR 0026): until it is, a fault of an
opted-in job is recovered as any other's, by a full restart, and the ranks run
``trainpod.elastic.run`` with the environment the controller and the agent give them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from trainpod.api.models import ChaosRequest
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
WORKER = Path(__file__).parent / "workers" / "elastic_dp.py"


@pytest.mark.timeout(240)
def test_an_opted_in_job_gets_its_recover_file_and_falls_back_to_a_full_restart(
    cluster: Cluster, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    argv = ["python", str(WORKER), "--steps", "150", "--out", str(out)]
    argv += ["--mark-at", "5", "--step-sleep", "0.1", "--wait-s", "120"]
    job = cluster.submit(argv, nodes=2, procs_per_node=2, auto_resume=True, recovery="in-process")
    assert cluster.client.job(job.id).spec.recovery == "in-process"
    wait_until(
        lambda: all((out / f"at-5-rank-{r}").exists() for r in range(4)),
        timeout_s=90,
        what="every rank past step 5",
    )
    for mark in out.glob("at-5-*"):
        mark.unlink()  # the restarted attempt marks again
    # 145 steps of 0.1 s are left: the kill lands long before the attempt could end
    cluster.client.chaos(ChaosRequest(node="workers-1", fault="kill-worker", rank=3))
    done = cluster.wait_job(job.id, timeout_s=180)
    assert done.state == "completed", cluster.describe(done)
    first, second = done.attempts
    assert first.cause == "crash"
    assert all(r.exit_code == 0 for r in second.ranks)
    kinds = [e.kind for e in cluster.client.events(job_id=job.id)]
    assert kinds.count("recovery_decision") == 1
    results = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    assert {r["steps"] for r in results} == {150}
    assert len({json.dumps(r["params"]) for r in results}) == 1
    # every rank was told where its node's recover file is: the job's scratch dir there
    files = [r["recover_file"] for r in results]
    assert all(f.endswith(f"job-{job.id}/recover.json") for f in files), files
    assert files[0] == files[1] != files[2] == files[3]
    cluster.wait_idle()
