"""A Megatron-style TP x DP script under trainpod: layout hint, a rank killed, resumed (ADR 0038).

``examples/megatron/pretrain_gpt.py`` on 2 nodes x 2 processes with ``parallelism: {tensor:
2}``: the sizes reach the script as ``TRAINPOD_TP``/``TRAINPOD_PP`` (its command names
neither), each TP group is on one node, a rank is killed after a checkpoint was committed, and
the restarted attempt resumes from the iteration Megatron's tracker file names and computes,
from there on, the losses of an undisturbed torchrun run with the same layout. CPU over
Gloo, where Megatron would use NCCL on GPUs.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from trainpod.api.models import ChaosRequest, JobInfo
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "pretrain_gpt.py"
ITERS, EVERY = 12, 4
MODEL = [
    "--num-layers=2",
    "--hidden-size=32",
    "--num-attention-heads=4",
    "--seq-length=16",
    "--vocab-size=64",
    "--micro-batch-size=2",
    "--global-batch-size=8",
    f"--train-iters={ITERS}",
    "--lr=3e-3",
    "--mock-data",
]
CKPT = ["--save=ckpt", "--load=ckpt", f"--save-interval={EVERY}"]
LOSS = re.compile(r"^ iteration +(\d+)/ *\d+ \|.*\| lm loss: (\S+) \|", re.MULTILINE)


def losses(log: str) -> dict[int, float]:
    return {int(it): float(loss) for it, loss in LOSS.findall(log)}


def reference(workdir: Path) -> subprocess.Popen[str]:
    """The undisturbed run, started in the background: torchrun, 4 ranks, TP 2."""
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "TORCHELASTIC"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += [str(SCRIPT), "--tensor-model-parallel-size=2", *MODEL]
    return subprocess.Popen(
        cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def tracker(cluster: Cluster) -> int | None:
    path = cluster.workdir / "ckpt" / "latest_checkpointed_iteration.txt"
    return int(path.read_text()) if path.is_file() else None


def test_a_tp2_dp2_job_resumes_from_its_committed_iteration_after_a_rank_is_killed(
    cluster: Cluster, tmp_path: Path
) -> None:
    # `trainpod submit` as a user types it; the processes per node: the nodes' 2 devices
    bad = cluster.cli("submit", "-N", "2", "--tensor-parallel", "4", "--", "true", check=False)
    said = " ".join((bad.stdout + bad.stderr).split())
    assert bad.returncode != 0 and "tensor parallel size 4 does not divide the 2 processes" in said

    argv = ["python", str(SCRIPT), *MODEL, *CKPT, "--iter-delay-s=0.4"]
    flags = ["-N", "2", "--auto-resume", "--tensor-parallel", "2", "--json"]
    job = JobInfo.model_validate_json(cluster.cli("submit", *flags, "--", *argv).stdout)
    ref = reference(tmp_path / "ref")
    try:
        committed = wait_until(lambda: tracker(cluster), timeout_s=120, what="the first checkpoint")
        node = cluster.client.job(job.id).attempts[-1].nodes[1]
        cluster.client.chaos(ChaosRequest(node=node, fault="kill-worker", rank=3))
        out, _ = ref.communicate(timeout=120)
    finally:
        ref.kill()
    assert ref.returncode == 0, out[-3000:]
    expected = losses(out)
    assert sorted(expected) == list(range(1, ITERS + 1)), out[-3000:]

    done = cluster.wait_job(job.id, timeout_s=120)
    assert done.state == "completed", cluster.describe(done)
    assert [a.cause for a in done.attempts[:-1]] == ["crash"], done.attempts
    first, second = (cluster.client.logs(job.id, rank=0, attempt=n).data for n in (1, 2))
    assert "world 4 = TP 2 x PP 1 x DP 2" in first  # from TRAINPOD_TP: the command has no flag
    for rank, node_rank in ((0, 0), (1, 0), (2, 1), (3, 1)):  # a TP group on one node
        assert re.search(
            rf"rank {rank}: tp {rank % 2} dp {rank // 2} pp 0 on node {node_rank}", first
        )
    m = re.search(r"loading checkpoint from ckpt at iteration (\d+)", second)
    assert m is not None, second[-3000:]
    resumed = int(m.group(1))
    assert resumed >= committed and resumed % EVERY == 0 and resumed < ITERS
    got = losses(second)
    assert sorted(got) == list(range(resumed + 1, ITERS + 1)), second[-3000:]
    for it, loss in got.items():  # the same continuation as the undisturbed run
        assert math.isclose(loss, expected[it], rel_tol=1e-6), (it, loss, expected[it])
    shown = cluster.cli("show", str(job.id)).stdout
    assert "parallel   TP 2 x PP 1 x DP (the rest)" in shown, shown
    bitwise = all(loss == expected[it] for it, loss in got.items())
    print(
        f"resumed from iteration {resumed} (committed {committed} at the kill); bitwise {bitwise}"
    )
    final = json.loads(second.split("\nfinal ", 1)[1].splitlines()[0])
    assert final == {"iteration": ITERS, "lm_loss": got[ITERS]}


def torchrun(workdir: Path, procs: int, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "TORCHELASTIC"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={procs}", str(SCRIPT), *args]
    p = subprocess.run(
        cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.mark.timeout(150)  # two torchrun runs of 4 and 2 ranks, no cluster
def test_a_checkpoint_of_a_tp2_pp2_run_resumes_at_another_layout_with_the_same_losses(
    tmp_path: Path,
) -> None:
    """Pipeline stages and TP shards are saved under global names and offsets (DTensors), so
    TP 1 x DP 2 reads what TP 2 x PP 2 wrote; and its next losses are the PP run's own: the
    PP schedule and the TP layers compute what the unsplit model does."""
    short = [a for a in MODEL if not a.startswith("--train-iters")] + ["--train-iters=4"]
    ckpt = ["--save=ckpt", "--save-interval=2"]
    split = torchrun(
        tmp_path,
        4,
        "--tensor-model-parallel-size=2",
        "--pipeline-model-parallel-size=2",
        *short,
        *ckpt,
    )
    assert "world 4 = TP 2 x PP 2 x DP 1" in split
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    whole = torchrun(tmp_path, 2, *short, "--load=ckpt")
    assert "world 2 = TP 1 x PP 1 x DP 2" in whole
    assert "successfully loaded checkpoint from ckpt at iteration 2" in whole
    expected, got = losses(split), losses(whole)
    assert sorted(got) == [3, 4] and sorted(expected) == [1, 2, 3, 4]
    for it, loss in got.items():
        assert math.isclose(loss, expected[it], rel_tol=1e-5), (it, loss, expected[it])
