"""Jobs on a real local cluster: launch, torchrun contract, failure teardown, cancel."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster, pid_alive
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
WORKERS = Path(__file__).parent / "workers"


def test_two_nodes_two_procs_allreduce(cluster: Cluster) -> None:
    job = cluster.submit(["python", str(WORKERS / "allreduce.py")], nodes=2, procs_per_node=2)
    done = cluster.wait_job(job.id)
    assert done.state == "completed", done.reason
    (attempt,) = done.attempts
    assert sorted(attempt.nodes) == ["workers-0", "workers-1"]
    assert [r.exit_code for r in attempt.ranks] == [0, 0, 0, 0]
    for rank in range(4):
        log = cluster.client.logs(job.id, rank=rank).data
        assert f"ok rank={rank} world=4 sum=6.0" in log
    # ranks on one node share its scratch dir; nodes differ
    logs = [cluster.client.logs(job.id, rank=r).data for r in range(4)]
    scratch = [line.split("scratch=")[1].split()[0] for line in logs]
    assert scratch[0] == scratch[1] != scratch[2] == scratch[3]
    kinds = [e.kind for e in cluster.client.events(job_id=job.id)]
    assert kinds.count("rank_started") == 4 and kinds.count("rank_exited") == 4
    cluster.wait_idle()


def test_unmodified_torchrun_script(cluster: Cluster) -> None:
    job = cluster.submit(["python", str(WORKERS / "torchrun_style.py")], nodes=2, procs_per_node=1)
    done = cluster.wait_job(job.id)
    assert done.state == "completed", done.reason
    assert "torchrun-style rank 1 done" in cluster.client.logs(job.id, rank=1).data


def test_failing_rank_tears_down_the_rest(cluster: Cluster, tmp_path: Path) -> None:
    d = tmp_path / "hold"
    d.mkdir()
    job = cluster.submit(
        ["python", str(WORKERS / "hold.py"), str(d), "3", "7", "--ignore-term"],
        nodes=2,
        procs_per_node=2,
    )
    done = cluster.wait_job(job.id)
    assert done.state == "failed"
    assert "rank 3 on workers-1 exited with code 7" in done.reason
    assert "something went wrong, exiting with 7" in done.reason  # the log tail
    (attempt,) = done.attempts
    assert attempt.cause == "crash"
    others = [r for r in attempt.ranks if r.rank != 3]
    # the survivors ignored SIGTERM, so the grace period ran out and SIGKILL ended them
    assert all(r.signal == 9 for r in others), [(r.rank, r.signal, r.exit_code) for r in others]
    for pid_file in d.glob("pid-*"):
        assert not pid_alive(int(pid_file.read_text()))
    cluster.wait_idle()


def test_cancel_kills_every_rank(cluster: Cluster, tmp_path: Path) -> None:
    d = tmp_path / "hold"
    d.mkdir()
    job = cluster.submit(["python", str(WORKERS / "hold.py"), str(d)], nodes=2, procs_per_node=2)
    wait_until(lambda: len(list(d.glob("pid-*"))) == 4, timeout_s=30, what="4 ranks")
    pids = [int(p.read_text()) for p in d.glob("pid-*")]
    out = cluster.cli("cancel", str(job.id))
    assert "job" in out.stdout
    done = cluster.wait_job(job.id)
    assert done.state == "cancelled"
    assert done.attempts[0].state == "cancelled"
    assert all(r.signal == 15 for r in done.attempts[0].ranks)
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout_s=10, what="ranks gone")
    cluster.wait_idle()


def test_fifo_queue_and_cancel_queued(cluster: Cluster, tmp_path: Path) -> None:
    d = tmp_path / "hold"
    d.mkdir()
    first = cluster.submit(["python", str(WORKERS / "hold.py"), str(d)], nodes=2, procs_per_node=1)
    second = cluster.submit(["true"], nodes=1, procs_per_node=1)
    third = cluster.submit(["true"], nodes=1, procs_per_node=1)
    wait_until(lambda: len(list(d.glob("pid-*"))) == 2, timeout_s=30, what="first job running")
    assert cluster.client.job(second.id).state == "queued"
    cluster.client.cancel(third.id)
    assert cluster.client.job(third.id).state == "cancelled"
    (d / "release").touch()
    assert cluster.wait_job(first.id).state == "completed"
    assert cluster.wait_job(second.id).state == "completed"
    # the spare was never used
    nodes = {a for j in (first, second) for a in cluster.client.job(j.id).attempts[0].nodes}
    assert "spares-0" not in nodes


def test_argv_is_never_interpolated_by_a_shell(cluster: Cluster) -> None:
    out = cluster.cli(
        "submit",
        "--wait",
        "--",
        "python",
        "-c",
        "import sys; print(sys.argv[1:])",
        "$HOME; echo pwned",
        "*",
    )
    assert "['$HOME; echo pwned', '*']" in out.stdout


def test_bad_submissions_get_clear_errors(cluster: Cluster) -> None:
    out = cluster.cli("submit", "-N", "3", "--", "true", check=False)
    assert out.returncode == 2
    assert "asks for 3 nodes" in out.stderr and "--nodes 2 or fewer" in out.stderr
    out = cluster.cli("submit", "--partition", "nope", "--", "true", check=False)
    assert "partition 'nope' does not exist" in out.stderr
    out = cluster.cli("submit", "-p", "5", "--", "true", check=False)
    assert "--procs-per-node 2 or fewer" in out.stderr
    job = cluster.submit(["no-such-command-xyz"])
    done = cluster.wait_job(job.id)
    assert done.state == "failed" and "exited with code 127" in done.reason
    assert "cannot start" in done.reason


@pytest.mark.timeout(120)
def test_gpt_example_trains_and_resumes(cluster: Cluster) -> None:
    example = Path(__file__).parents[2] / "examples" / "gpt" / "train.py"
    shutil.copy(example, cluster.workdir / "train.py")
    tiny = [
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--ckpt-every",
        "3",
        "--log-every",
        "1",
    ]
    job = cluster.submit(["python", "train.py", "--steps", "6", *tiny], nodes=2, procs_per_node=1)
    done = cluster.wait_job(job.id)
    assert done.state == "completed", done.reason
    assert "done: steps=6" in cluster.client.logs(job.id, rank=0).data
    # a second job with the same checkpoint dir resumes from step 6
    ckpt = Path(cluster.record.checkpoint_uri.removeprefix("file://")) / f"job-{job.id}"
    assert (ckpt / "step-0000000006" / "manifest.json").exists()
    again = cluster.submit(
        ["python", "train.py", "--steps", "9", "--ckpt-dir", str(ckpt), *tiny],
        nodes=2,
        procs_per_node=1,
    )
    done = cluster.wait_job(again.id)
    assert done.state == "completed", done.reason
    log = cluster.client.logs(again.id, rank=0).data
    assert "resuming from" in log and "done: steps=9" in log
