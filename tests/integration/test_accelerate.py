"""An ``accelerate`` script under trainpod, unmodified (ADR 0030).

``examples/accelerate/train.py`` (``Accelerator``, ``prepare``, ``save_state`` every 10 steps
into ``ckpt/step_N``, ``--resume_from_checkpoint`` → ``load_state``) runs on a 2-node local
cluster as written for ``accelerate launch``/torchrun; rank 1 is killed after ``step_10``
and ``--auto-resume`` brings it back from its newest complete state, which trainpod fills
in for ``--resume_from_checkpoint={resume:ckpt}``; the final loss is bitwise that of an
undisturbed run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_hf import (
    final,
    rank_log,
    reference_run,
    resumed_from,
    submit,
    wait_done,
)
from trainpod.api.models import ChaosRequest
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "accelerate" / "train.py"
ARGS = ["--output_dir=ckpt", "--max_steps=30", "--checkpointing_steps=10"]


@pytest.mark.timeout(420)
def test_an_unmodified_accelerate_script_resumes_from_its_own_state_after_a_fault(
    cluster: Cluster, tmp_path: Path
) -> None:
    reference = reference_run(SCRIPT, ARGS, tmp_path / "ref")
    argv = ["python", str(SCRIPT), *ARGS, "--step_delay_s=0.5"]
    job = submit(cluster, [*argv, "--resume_from_checkpoint={resume:ckpt}"])
    ckpt = cluster.workdir / "ckpt" / "step_10"
    wait_until(
        lambda: all((ckpt / f"random_states_{r}.pkl").is_file() for r in (0, 1)),
        timeout_s=180,
        what="ckpt/step_10",
    )
    node = cluster.client.job(job.id).attempts[-1].nodes[1]
    cluster.client.chaos(ChaosRequest(node=node, fault="kill-worker", rank=1))  # halfway
    done = wait_done(cluster, job.id)
    assert len(done.attempts) == 2 and done.attempts[0].cause == "crash", done.attempts
    first, second = rank_log(cluster, job.id, 1), rank_log(cluster, job.id, 2)
    assert "world size 2, resume from None" in first
    path = resumed_from(second, "ckpt")
    assert re.fullmatch(r"ckpt/step_(10|20)", path), path
    assert f"world size 2, resume from {path}" in second
    assert final(second) == reference  # bitwise
