"""Every job's TensorBoard logdir, end to end: a real training job on a real local cluster
reports loss through beacons and writes its own SummaryWriter run, is killed once (chaos
kill-worker) and resumes from its checkpoint; the event files are read back with
TensorBoard's own reader, and ``trainpod tensorboard JOB`` serves them with the real
``tensorboard`` program.

Both halves share one cluster and one job (this box has two cores shared by many)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.conftest import Cluster
from tests.integration.test_self_healing import SPEC, Training, train
from trainpod.telemetry.tensorboard import GOODPUT_RUN, STEPS_RUN, tensorboard_dir
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
STEPS = 60


def read(run: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.timeout(200)
def test_a_killed_and_resumed_job_shows_each_step_once_and_its_restart(
    make_cluster_from_spec: Callable[[str], Cluster],
) -> None:
    cluster = make_cluster_from_spec(SPEC)
    t = train(cluster, steps=STEPS, step_s=0.1, extra=("--tensorboard",))
    t.wait_progress(step=15)  # past the checkpoint at 10: steps 11.. are redone
    t.chaos("workers-1", "kill-worker", rank=1)
    t.wait(timeout_s=90)
    resume = t.check_nothing_lost(attempts=2)
    assert resume > 1  # from a checkpoint, with steps after it redone
    logdir = tensorboard_dir(Path(cluster.record.shared_dir), t.job_id)
    check_step_scalars(t, logdir / STEPS_RUN, resume)
    check_goodput(t, logdir / GOODPUT_RUN)
    # the script's own SummaryWriter (purge_step=the resumed step) beside trainpod's runs
    script = [s for s, _ in scalars(read(logdir / "script"), "value")]
    assert script == list(range(1, STEPS + 1))
    check_tensorboard_serves(cluster, t, logdir)
    unknown = cluster.cli("tensorboard", "999", check=False)
    assert unknown.returncode == 2 and "999" in unknown.stderr, unknown.stderr


def check_step_scalars(t: Training, run: Path, resume: int) -> None:
    """Every step's loss once; steps from the resume on are attempt 2's; the restart is a text
    at the resumed step that says why."""
    want = list(range(1, STEPS + 1))

    def steps() -> EventAccumulator | None:  # the agent flushes after each batch it writes
        acc = read(run)
        return acc if [s for s, _ in scalars(acc, "metrics/loss")] == want else None

    acc = wait_until(steps, timeout_s=30, what=f"each of steps 1..{STEPS} once in {run}")
    assert all(abs(v - 1.0 / s) < 1e-6 for s, v in scalars(acc, "metrics/loss"))
    attempt = dict(scalars(acc, "trainpod/attempt"))
    assert attempt == {s: 1.0 if s < resume else 2.0 for s in want}
    texts = [
        (e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("trainpod/attempts")
    ]
    assert [s for s, _ in texts] == [1, resume], texts
    assert texts[1][1].startswith(f"attempt 2 resumed at step {resume}: crash: rank 1 on workers-1")
    rates = scalars(acc, "trainpod/steps_per_s")
    assert rates and all(r > 0 for _, r in rates)
    assert {s for s, _ in rates} == set(want) - {1, resume}  # a rate needs a step before it
    assert sorted(p.name.rsplit(".", 1)[-1] for p in run.iterdir()) == ["attempt-1", "attempt-2"]


def check_goodput(t: Training, run: Path) -> None:
    """The controller wrote the job's goodput, restarts and seconds by bucket; the last point
    is the finished job's, the goodput `trainpod goodput` shows."""
    job = t.client.job(t.job_id)
    assert job.ended_at is not None
    ended = int(job.ended_at - job.submitted_at)  # the final point is written after the end

    def final() -> EventAccumulator | None:
        acc = read(run) if run.is_dir() else None
        last = scalars(acc, "goodput/restarts")[-1:] if acc is not None else []
        return acc if last and last[0][0] >= ended else None

    acc = wait_until(final, timeout_s=30, what=f"the ended job's goodput point in {run}")
    restarts = scalars(acc, "goodput/restarts")
    assert restarts[-1][1] == 1.0, restarts
    steps = [s for s, _ in restarts]
    assert steps == sorted(set(steps))  # one point per second of the job, never twice
    goodput = scalars(acc, "goodput/goodput")
    assert 0.0 < goodput[-1][1] <= 1.0, goodput
    assert goodput[-1][1] == pytest.approx(t.client.goodput(t.job_id)["goodput"], abs=1e-6)
    assert scalars(acc, "goodput/seconds/recomputed")[-1][1] > 0  # steps 11.. were redone


def check_tensorboard_serves(cluster: Cluster, t: Training, logdir: Path) -> None:
    """``trainpod tensorboard JOB`` prints a URL that serves TensorBoard, whose runs are
    trainpod's two and the script's own, and whose loss curve has each step once; Ctrl-C
    stops it."""
    env = {**os.environ, "COLUMNS": "200", "TRAINPOD_CLUSTER": cluster.paths.name}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainpod.cli.main", "tensorboard", str(t.job_id)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:  # ends when the CLI exits (it then failed: the assert says why)
            lines.append(line)
            if m := re.search(r"http://127\.0\.0\.1:\d+/", line):
                break
        assert m, "".join(lines)
        url = m.group(0)
        page = httpx.get(url, timeout=10)
        assert page.status_code == 200 and "<title>TensorBoard" in page.text, page.text[:300]

        def runs() -> list[str] | None:
            got = httpx.get(url + "data/runs", timeout=10).json()
            return got if {"trainpod", "trainpod-goodput", "script"} <= set(got) else None

        wait_until(runs, timeout_s=60, what=f"the job's runs at {url}data/runs")
        scalars_url = f"{url}data/plugin/scalars/scalars?run=trainpod&tag=metrics/loss"

        def served() -> list[int] | None:  # [[wall_time, step, value], ...] once loaded
            steps = [int(p[1]) for p in httpx.get(scalars_url, timeout=10).json()]
            return steps if len(set(steps)) == STEPS else None

        steps = wait_until(served, timeout_s=60, what=f"the loss curve at {scalars_url}")
        assert steps == list(range(1, STEPS + 1))  # served purged too: each step once
        assert str(logdir) in "".join(lines)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, timeout=2)
