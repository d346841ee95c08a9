"""Hugging Face ``Trainer`` scripts under trainpod, unmodified (ADR 0030).

``examples/hf/train.py`` runs on a 2-node local cluster, one rank a node, as written for
``torchrun --nnodes 2``: a fault injected halfway (rank 1 killed after ``checkpoint-10``),
and ``--auto-resume`` brings it back from its own newest complete ``checkpoint-N``, which
trainpod hands over through ``--resume_from_checkpoint={resume:out}``; the final loss is
bitwise that of an undisturbed run (HF restores model, optimizer, scheduler, the data
position and every rank's RNG). With ``TrainpodCallback`` a preemption notice makes HF save
and stop, the job resumes from that save, and its beacons show in ``jobs show`` and
``/metrics``. The model is a 2-layer GPT-2 built from a config: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import Cluster
from trainpod.api.models import ChaosRequest, JobInfo
from trainpod.cli.jobs import default_env
from trainpod.controller.policy import teardown_abort as teardown_aborted
from trainpod.paths import read_secret
from trainpod.spec.job import JobSpec
from trainpod.telemetry.tensorboard import tensorboard_dir
from trainpod.testing.wait import WaitTimeout, wait_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "hf" / "train.py"
STEPS, EVERY = 30, 10
ARGS = [
    "--output_dir=out",
    f"--max_steps={STEPS}",
    f"--save_steps={EVERY}",
    "--per_device_train_batch_size=4",
    "--logging_steps=1",
    "--use_cpu",
    "--report_to=none",
    "--seed=7",
    "--data_seed=7",
    "--disable_tqdm=true",
]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "warning"}
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")


def final(log: str) -> dict[str, object]:
    """The script's last line: ``final {"step": .., "loss": .., ...}`` (rank 0)."""
    lines = [line for line in log.splitlines() if line.startswith("final {")]
    assert lines, f"no final line in:\n{log[-3000:]}"
    out: dict[str, object] = json.loads(lines[-1].removeprefix("final "))
    return out


def reference_run(script: Path, args: list[str], workdir: Path) -> dict[str, object]:
    """The undisturbed run: torchrun on this machine, 2 ranks, the same arguments."""
    workdir.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env = {k: v for k, v in env.items() if not k.startswith(("TRAINPOD_", "TORCHELASTIC_"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2"]
    cmd += ["--standalone", str(script), *args]
    env.update(OFFLINE, OMP_NUM_THREADS="1")
    p = subprocess.run(
        cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    said = f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert p.returncode == 0 or teardown_abort(p.stdout, p.stderr), said
    return final(p.stdout)


def teardown_abort(stdout: str, stderr: str) -> bool:
    """torchrun failed only because a rank aborted in its interpreter's teardown, after the
    script had printed its final line: a script that never calls ``destroy_process_group``
    (HF's ``Trainer`` does not) may die of SIGABRT in Gloo's teardown
    (pytorch/pytorch#179291), under torchrun as under trainpod. The run's result stands."""
    aborted = "terminate called without an active exception" in stderr
    return aborted and "exitcode  : -6" in stderr and "\nfinal {" in f"\n{stdout}"


def submit(cluster: Cluster, argv: list[str]) -> JobInfo:
    spec = JobSpec(
        command=argv,
        env={**default_env(), **OFFLINE},
        workdir=str(cluster.workdir),
        nodes=2,
        procs_per_node=1,
        auto_resume=True,
    )
    return cluster.client.submit(spec)


def rank_log(cluster: Cluster, job_id: int, attempt: int, rank: int = 0) -> str:
    return cluster.client.logs(job_id, rank=rank, attempt=attempt).data


def wait_done(cluster: Cluster, job_id: int) -> JobInfo:
    try:
        done = cluster.wait_job(job_id, timeout_s=240)
    except WaitTimeout as exc:
        number = len(cluster.client.job(job_id).attempts)
        tails = [rank_log(cluster, job_id, number, r)[-3000:] for r in (0, 1)]
        raise WaitTimeout(f"{exc}\n" + "\n".join(tails)) from None
    assert done.state == "completed", (done.reason, rank_log(cluster, job_id, 1)[-3000:])
    return done


def resumed_from(log: str, folder: str) -> str:
    """The checkpoint trainpod said it filled in for ``{resume:<folder>}``."""
    m = re.search(rf"^trainpod: \{{resume:{folder}\}}: resuming from (\S+)", log, re.MULTILINE)
    assert m is not None, f"no resume line in:\n{log[:3000]}"
    return m.group(1)


def complete_checkpoint(out: Path, step: int) -> bool:
    return (out / f"checkpoint-{step}" / "trainer_state.json").is_file()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return reference_run(SCRIPT, ARGS, tmp_path_factory.mktemp("hf") / "ref")


@pytest.mark.timeout(600)  # the module's reference run starts here
def test_an_unmodified_trainer_script_resumes_from_its_own_checkpoint_after_a_fault(
    cluster: Cluster, reference: dict[str, object]
) -> None:
    argv = ["python", str(SCRIPT), *ARGS, "--step_delay_s=0.5"]
    job = submit(cluster, [*argv, "--resume_from_checkpoint={resume:out}"])
    out = cluster.workdir / "out"
    wait_until(lambda: complete_checkpoint(out, EVERY), timeout_s=180, what="checkpoint-10")
    node = cluster.client.job(job.id).attempts[-1].nodes[1]
    cluster.client.chaos(ChaosRequest(node=node, fault="kill-worker", rank=1))  # halfway
    done = wait_done(cluster, job.id)
    assert len(done.attempts) == 2 and done.attempts[0].cause == "crash", done.attempts
    first, second = rank_log(cluster, job.id, 1), rank_log(cluster, job.id, 2)
    assert "{resume:out}: no out yet; '--resume_from_checkpoint={resume:out}' left out" in first
    assert "world size 2, resume from None" in first  # torchrun's env: 2 ranks, not 1
    path = resumed_from(second, "out")
    assert re.fullmatch(r"out/checkpoint-(10|20)", path), path
    assert f"world size 2, resume from {path}" in second
    assert final(second) == reference  # bitwise: the same loss as the undisturbed run


@pytest.mark.timeout(420)
def test_a_preemption_notice_makes_hf_save_and_the_job_resumes_from_that_save(
    cluster: Cluster, reference: dict[str, object]
) -> None:
    argv = ["python", str(SCRIPT), *ARGS, "--step_delay_s=0.5", "--trainpod_callback"]
    job = submit(cluster, [*argv, "--resume_from_checkpoint={resume:out}"])

    def beacons() -> dict[str, object] | None:  # the callback's beacons, as jobs show has them
        shown = json.loads(cluster.cli("show", str(job.id), "--json").stdout)
        progress = shown.get("progress") or {}
        step = progress.get("last_step")
        return progress if isinstance(step, int) and step >= 2 else None

    progress = wait_until(beacons, timeout_s=180, what=f"job {job.id}'s beacons")
    assert progress["ranks"] == 2
    token = read_secret(cluster.paths.admin_token)
    metrics = httpx.get(
        f"{cluster.record.url}/metrics", headers={"Authorization": f"Bearer {token}"}
    ).text
    jid = f'job_id="{job.id}"'
    loss = re.search(rf"^trainpod_job_loss{{[^}}]*{jid}[^}}]*}} (\S+)", metrics, re.MULTILINE)
    tokens = re.search(rf"^trainpod_job_tokens_total{{[^}}]*{jid}[^}}]*}} (\S+)", metrics, re.M)
    assert loss is not None and 0 < float(loss.group(1)) < 10, metrics
    assert tokens is not None and float(tokens.group(1)) > 0, metrics

    cluster.client.preempt(job.id, "a test needs the nodes", grace_s=120)
    done = wait_done(cluster, job.id)
    first, second = done.attempts
    assert (first.cause, second.state) == ("preempted", "succeeded"), done.attempts
    # It stopped on its own after saving, not at the grace's kill: each rank exited 0, or
    # aborted in its interpreter's teardown after that (HF's Trainer never destroys its
    # process group: pytorch/pytorch#179291), as the controller's own classifier tells.
    for r in first.ranks:
        tail = rank_log(cluster, job.id, 1, r.rank)[-3000:]
        assert r.exit_code == 0 or teardown_aborted(r.signal, tail), (r, tail)
    m = re.search(
        r"notice received: saving checkpoint-(\d+), stopping", rank_log(cluster, job.id, 1)
    )
    assert m is not None, rank_log(cluster, job.id, 1)[-3000:]
    saved = int(m.group(1))
    assert 2 <= saved < STEPS
    log = rank_log(cluster, job.id, 2)
    assert resumed_from(log, "out") == f"out/checkpoint-{saved}"  # HF's save on the notice
    assert final(log) == reference
    tb = tensorboard_dir(Path(cluster.record.shared_dir), job.id)
    logdir = tb / "hf"  # integrations.hf.TENSORBOARD_RUN
    runs = sorted(logdir.glob("events.out.tfevents.*"))
    assert len(runs) == 2, runs  # rank 0's SummaryWriter, one file an attempt
