"""Warm starts with torch preloaded: Gloo jobs, DataLoader workers, a real local cluster."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from trainpod.agent.launcher import Launcher
from trainpod.agent.warmstart import WarmStarter, agents_zygote_env
from trainpod.api.models import LaunchOrder, RankReport, RankSlot
from trainpod.cli.jobs import default_env
from trainpod.controller.ports import free_port
from trainpod.spec.job import JobSpec
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
WORKERS = Path(__file__).parent / "workers"
BIN = str(Path(sys.executable).parent)
READY = re.compile(r"warm-start server \(pid \d+\) ready")


@pytest.fixture(scope="module")
def warm() -> Iterator[WarmStarter]:
    short = Path(tempfile.mkdtemp(prefix="tpz-"))  # a Unix socket path must stay short
    w = WarmStarter(socket_path=short / "z.sock", log_path=short / "z.log", env=agents_zygote_env())
    w.start()
    wait_until(lambda: w.ready, timeout_s=120, what="the zygote to import torch")
    yield w
    w.close()
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def launcher(warm: WarmStarter, caplog: pytest.LogCaptureFixture) -> Iterator[Launcher]:
    caplog.set_level(logging.INFO, logger="trainpod.agent.launcher")
    launcher = Launcher(node_env={}, on_change=lambda: None, warm=warm)
    yield launcher
    launcher.kill_everything()


def launch(launcher: Launcher, attempt: int, argv: list[str], cwd: Path, **env: str) -> None:
    port = free_port()
    env = {
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        **env,
    }
    order = LaunchOrder(
        attempt_id=attempt,
        job_id=1,
        attempt_number=attempt,
        argv=argv,
        workdir=str(cwd),
        env=env,
        ranks=[RankSlot(rank=r, local_rank=r) for r in range(2)],
        log_dir=str(cwd / f"attempt-{attempt}"),
    )
    assert launcher.launch(order)


def ended(launcher: Launcher, attempt: int) -> list[RankReport]:
    def done() -> list[RankReport] | None:
        (rep,) = [a for a in launcher.reports() if a.attempt_id == attempt]
        return rep.ranks if all(r.state == "exited" for r in rep.ranks) else None

    return wait_until(done, timeout_s=120, what=f"attempt {attempt} to end")


def rank_log(cwd: Path, attempt: int, rank: int) -> str:
    return (cwd / f"attempt-{attempt}" / f"rank-{rank}.log").read_text()


def started(caplog: pytest.LogCaptureFixture, attempt: int) -> list[str]:
    return [m.split(": ")[1][:10] for m in caplog.messages if f"of attempt {attempt}: " in m]


def test_two_gloo_ranks_from_the_zygote_all_reduce(
    launcher: Launcher, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(
        textwrap.dedent(
            """\
            import os
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_* from os.environ
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            print(f"rank {os.environ['RANK']} of {dist.get_world_size()}: sum {t.item()}")
            dist.destroy_process_group()
            """
        )
    )
    launch(launcher, 1, ["python", str(script)], tmp_path)
    assert [r.exit_code for r in ended(launcher, 1)] == [0, 0]
    assert started(caplog, 1) == ["warm start", "warm start"]
    for rank in (0, 1):
        assert f"rank {rank} of 2: sum 3.0" in rank_log(tmp_path, 1, rank)


def test_torch_in_a_warm_rank_is_torch_in_a_cold_one(
    launcher: Launcher, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = tmp_path / "probe.py"
    script.write_text(
        textwrap.dedent(
            """\
            import json, os, random
            import torch
            from torch.utils.data import DataLoader

            def main():
                loader = DataLoader(list(range(8)), batch_size=2, num_workers=2)
                print(json.dumps({
                    "batches": sum(b.sum().item() for b in loader),
                    "threads": torch.get_num_threads(),
                    "cuda": torch.cuda.is_initialized(),
                    # seeded from the OS at start: differ between ranks, warm or cold
                    "random": [random.random(), torch.initial_seed(), torch.rand(2).tolist()],
                    "rank": os.environ["RANK"],
                }))

            if __name__ == "__main__":
                main()
            """
        )
    )
    launch(launcher, 1, ["python", str(script)], tmp_path)
    launch(launcher, 2, ["python", str(script)], tmp_path, TRAINPOD_WARM_START="0")
    assert [r.exit_code for r in ended(launcher, 1) + ended(launcher, 2)] == [0] * 4
    assert started(caplog, 1) == ["warm start"] * 2
    assert started(caplog, 2) == ["cold start"] * 2
    out = {(a, r): json.loads(rank_log(tmp_path, a, r)) for a in (1, 2) for r in (0, 1)}
    randoms = [v.pop("random") for v in out.values()]
    for i, a in enumerate(randoms):
        assert all(x != y for b in randoms[i + 1 :] for x, y in zip(a, b, strict=True))
    assert out[1, 0] == out[2, 0] and out[1, 1] == out[2, 1]
    assert out[1, 0]["batches"] == 28 and out[1, 0]["threads"] == 1


def test_a_local_cluster_restarts_a_crashed_job_warm(cluster: Cluster) -> None:
    nodes = ["workers-0", "workers-1"]
    logs = [cluster.paths.node_dir(n) / "agent.log" for n in nodes]
    wait_until(
        lambda: all(READY.search(p.read_text()) for p in logs),
        timeout_s=120,
        what="both zygotes to import torch",
    )
    crash = cluster.workdir / "crash_once.py"
    crash.write_text(
        textwrap.dedent(
            f"""\
            import os, runpy, sys
            if os.environ["TRAINPOD_ATTEMPT"] == "1" and os.environ["RANK"] == "3":
                sys.exit("rank 3 crashes on the first attempt")
            runpy.run_path({str(WORKERS / "allreduce.py")!r}, run_name="__main__")
            """
        )
    )
    job = cluster.submit(
        ["python", str(crash)], nodes=2, procs_per_node=2, max_restarts=1, auto_resume=True
    )
    done = cluster.wait_job(job.id, timeout_s=180)
    assert done.state == "completed", done.reason
    assert done.attempts[0].cause == "crash"
    assert done.attempts[1].state == "succeeded"
    for rank in range(4):
        assert f"ok rank={rank} world=4 sum=6.0" in cluster.client.logs(job.id, rank=rank).data
    text = "\n".join(p.read_text() for p in logs)
    # Every rank of the restart starts warm. Of the first attempt, a rank whose start was
    # still queued when the kill order came is never started (the launcher obeys the kill),
    # so only its crashing rank 3 is sure to have started; whichever did started warm.
    assert text.count("of attempt 2: warm start, pid") == 4, text
    assert "rank 3 of attempt 1: warm start, pid" in text, text
    assert ": cold start" not in text, text
    # Once ready, each agent's zygote also imports what every training rank imports after
    # torch (an optimizer: dynamo; a Checkpointer: DCP), while it has nothing to serve.
    zygotes = [cluster.paths.node_dir(n) / "zygote.log" for n in nodes]
    warmed = "warmed torch._dynamo,torch.distributed.checkpoint"
    wait_until(
        lambda: all(warmed in p.read_text() for p in zygotes),
        timeout_s=120,
        what="both zygotes to import dynamo and DCP",
    )
    cluster.wait_idle()


SLOW_MODULE = """\
import os, time
PID = os.getpid()
with open(os.environ["IMPORTS_FILE"], "a") as f:
    f.write(f"{PID}\\n")
time.sleep(1.0)  # an import that takes long, as transformers' does
"""

PRELOAD_SCRIPT = """\
import os, sys, time
preloaded = "slowmod" in sys.modules
import slowmod
attempt = os.environ["TRAINPOD_ATTEMPT"]
print(f"attempt={attempt} preloaded={preloaded} imported_by={slowmod.PID} me={os.getpid()}",
      flush=True)
if attempt == "1":
    while not os.path.exists(os.environ["CRASH_FILE"]):  # the test says when
        time.sleep(0.1)
    sys.exit("attempt 1 crashes once its job's preload server is ready")
"""


def test_a_restart_forks_from_the_jobs_preload_server_with_its_modules_imported(
    make_cluster: Callable[..., Cluster],
) -> None:
    """``--preload slowmod``: the node's agent starts a warm-start server for the job that
    imports slowmod (from the job's working directory, with the job's environment); the
    restart after a crash forks from it, and its rank finds slowmod imported (by the server,
    not by itself). The first attempt could not wait for it."""
    cluster = make_cluster(workers=1)
    work = cluster.workdir
    (work / "slowmod.py").write_text(SLOW_MODULE)
    (work / "train.py").write_text(PRELOAD_SCRIPT)
    imports, crash = work / "imports.txt", work / "crash-now"
    env = {"IMPORTS_FILE": str(imports), "CRASH_FILE": str(crash), "PYTHONPATH": str(work)}
    job = cluster.client.submit(
        JobSpec(
            command=["python", str(work / "train.py")],
            env={**default_env(), **env},
            workdir=str(work),
            nodes=1,
            procs_per_node=1,
            auto_resume=True,
            max_restarts=1,
            preload=["slowmod"],
        )
    )
    node = cluster.paths.node_dir("workers-0")
    server_log = node / f"zygote-job-{job.id}.log"
    preloaded = re.compile(r"zygote (\d+): preloaded torch,torch.distributed,trainpod,slowmod")
    found = wait_until(
        lambda: preloaded.search(server_log.read_text()) if server_log.exists() else None,
        timeout_s=180,
        what=f"job {job.id}'s preload server to import slowmod",
    )
    server = int(found.group(1))
    ready = re.compile(rf"warm-start server \(pid {server}\) ready")
    wait_until(
        lambda: ready.search((node / "agent.log").read_text()),
        timeout_s=60,
        what="the agent to see the preload server ready",
    )
    crash.touch()
    done = cluster.wait_job(job.id, timeout_s=180)
    assert done.state == "completed", done.reason
    assert [a.cause for a in done.attempts][:1] == ["crash"] and len(done.attempts) == 2
    second = cluster.client.logs(job.id, rank=0, attempt=2).data
    assert f"attempt=2 preloaded=True imported_by={server} " in second, second
    assert str(server) in imports.read_text().split()  # the server imported it, once
    assert imports.read_text().split().count(str(server)) == 1
    agent = (node / "agent.log").read_text()
    starts = re.findall(r"rank 0 of attempt \d+: (warm|cold) start", agent)
    assert len(starts) == 2 and starts[-1] == "warm", starts  # the restart: warm
    cluster.wait_idle()
    wait_until(
        lambda: (
            f"job {job.id} has ended: its warm-start server closed"
            in (node / "agent.log").read_text()
        ),
        timeout_s=60,
        what="the job's preload server closed once it ended",
    )
