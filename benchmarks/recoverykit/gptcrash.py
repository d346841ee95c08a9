"""Part 5 of the recovery benchmark: a crash of the GPT example, three ways side by side.

The GPT example (``examples/gpt/train.py``: a 4-layer, 128-wide byte-level GPT with DDP over
Gloo, ``--ckpt-every auto``, its model and optimizer saved through ``trainpod.Checkpointer``)
on 2 ranks, rank 1 SIGKILLed ``repeats`` times, each time once the run has stepped WARM_S:

- ``torchrun``: ``torchrun --standalone --nproc-per-node 2 --max-restarts 3`` (every rank
  starts again and loads the newest checkpoint; a new torchrun after 3 restarts);
- ``restart``: a 2 x 1 trainpod job with ``--auto-resume`` (every rank starts again, from
  the agent's warm interpreter, and loads from the memory tier);
- ``in-process``: the same job with ``--recovery in-process`` (rank 0 keeps its process and
  its state; rank 1 starts again and takes the state from rank 0; ADR 0026, 0046);
- ``restart+preload``, ``in-process+preload``: the same with ``--preload`` PRELOAD (the job's
  own zygote, warm from its first start on, imports them once per node).

Figure per kill: *crash -> first step*, from the killed rank's last step line to the first
step line of its successor (another pid). A step is a DDP all-reduce, so that line also
means every rank steps again. Lines come from ``--progress-dir`` (one per step and rank).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recoverykit.common import (
    GPT,
    RECOVERY_TIMEOUT_S,
    START_TIMEOUT_S,
    TORCHRUN_MAX_RESTARTS,
    WARM_S,
    JobWatch,
    StepLine,
    end_job,
    median,
    node_of_rank,
    read_progress,
    wait_until,
)
from recoverykit.torchrun_cmp import Torchrun
from trainpod.api.models import ChaosRequest
from trainpod.cli.jobs import default_env
from trainpod.client.http import TrainpodClient
from trainpod.spec.job import JobSpec

MODES = ("torchrun", "restart", "in-process", "restart+preload", "in-process+preload")
PRELOAD = ["torch.distributed.checkpoint", "torch._dynamo"]
"""``--preload`` of the ``+preload`` modes: what a fresh GPT rank imports beyond the agent's
zygote (torch, torch.distributed, trainpod): DCP, for its Checkpointer, and dynamo, which
AdamW's constructor imports; together seconds per start on this box."""
TARGET_S = 1.0  # issue 12: crash -> first step for the GPT example, in process
FIRST_KILL_AFTER_S = 10.0
"""The first kill of a run comes this long after its start (every mode): a job's --preload
zygote warms up meanwhile (its ranks' first start cannot wait for it)."""


@dataclass
class Kill:
    mode: str
    pid: int  # the rank-1 process killed
    killed_at: float
    last_step_at: float | None = None  # its last step line
    next_step_at: float | None = None  # the first step line of the rank-1 process after it
    crash_to_step_s: float | None = None
    error: str = ""


def gpt_args(ckpt: Path, progress: Path) -> list[str]:
    return [
        str(GPT),
        "--steps",
        "1000000",
        "--ckpt-dir",
        str(ckpt),
        "--progress-dir",
        str(progress),
        "--log-every",
        "0",
    ]


def warm_rank1(progress: Path, after: float) -> StepLine | None:
    """Rank 1's newest line, once it has stepped WARM_S since ``after`` (and since its
    process's first step)."""
    mine = [x for x in read_progress(progress) if x.rank == 1 and x.step >= 0]
    if not mine:
        return None
    newest = mine[-1]
    first = min(x.t for x in mine if x.pid == newest.pid)
    return newest if newest.t - max(first, after) >= WARM_S else None


def successor(progress: Path, pid: int) -> tuple[float, float] | None:
    """(the last step line of ``pid``, the first step line of rank 1's next process)."""
    lines = [x for x in read_progress(progress) if x.rank == 1 and x.step >= 0]
    last = max((x.t for x in lines if x.pid == pid), default=None)
    if last is None:
        return None
    nxt = min((x.t for x in lines if x.pid != pid and x.t > last), default=None)
    return None if nxt is None else (last, nxt)


def _measure(k: Kill, progress: Path) -> None:
    try:
        k.last_step_at, k.next_step_at = wait_until(
            lambda: successor(progress, k.pid), RECOVERY_TIMEOUT_S, f"{k.mode}: rank 1 again"
        )
        k.crash_to_step_s = k.next_step_at - k.last_step_at
    except TimeoutError as exc:
        k.error = str(exc)


def run_torchrun_gpt(repeats: int, workdir: Path) -> list[Kill]:
    out: list[Kill] = []
    run: Torchrun | None = None
    restarts = runs = 0
    try:
        while len(out) < repeats:
            if run is None or restarts >= TORCHRUN_MAX_RESTARTS or not run.alive():
                if run is not None:
                    run.stop()
                runs += 1
                base = workdir / f"gpt-torchrun-{runs}"
                progress = base / "progress"
                run = Torchrun(
                    progress, workdir / "gpt-torchrun.log", gpt_args(base / "ckpt", progress)
                )
                restarts = 0
                since = time.time() + FIRST_KILL_AFTER_S - WARM_S
            line = wait_until(
                lambda p=progress, s=since: warm_rank1(p, s),  # type: ignore[misc]
                START_TIMEOUT_S,
                "torchrun's rank 1 to step",
            )
            k = Kill("torchrun", line.pid, time.time())
            os.kill(line.pid, signal.SIGKILL)
            out.append(k)
            _measure(k, progress)
            restarts += 1
            since = time.time()
            if k.error:
                run.stop()
                run = None
    finally:
        if run is not None:
            run.stop()
    return out


def run_trainpod_gpt(client: TrainpodClient, mode: str, repeats: int, workdir: Path) -> list[Kill]:
    recovery, _, preload = mode.partition("+")
    base = workdir / f"gpt-{mode.replace('+', '-')}"
    progress = base / "progress"
    spec = JobSpec(
        command=[sys.executable, *gpt_args(base / "ckpt", progress)],
        name=f"gpt-crash-{mode.replace('+', '-')}",
        nodes=2,
        procs_per_node=1,
        partition="main",
        env=default_env(),
        workdir=str(workdir),
        auto_resume=True,
        max_restarts=1000,
        recovery="in-process" if recovery == "in-process" else "restart",
        preload=PRELOAD if preload else [],
    )
    job = client.submit(spec)
    watch = JobWatch(client, job.id)
    out: list[Kill] = []
    try:
        watch.wait_beacon_after(0, START_TIMEOUT_S)
        since = time.time() + FIRST_KILL_AFTER_S - WARM_S
        for _ in range(repeats):
            line = wait_until(
                lambda s=since: warm_rank1(progress, s),  # type: ignore[misc]
                START_TIMEOUT_S,
                f"{mode}: rank 1 to step",
            )
            node, _ = node_of_rank(client, job.id, rank=1)
            k = Kill(mode, line.pid, time.time())
            client.chaos(ChaosRequest(node=node, fault="kill-worker", rank=1))
            out.append(k)
            _measure(k, progress)
            since = time.time()
            if k.error:
                break
    finally:
        end_job(client, job.id)
    return out


def run_gpt_crash(client: TrainpodClient, repeats: int, workdir: Path) -> dict[str, Any]:
    """Each mode ``repeats`` kills; torchrun first (no cluster job runs meanwhile)."""
    kills = run_torchrun_gpt(repeats, workdir)
    for mode in MODES[1:]:
        kills += run_trainpod_gpt(client, mode, repeats, workdir)
    summary: dict[str, Any] = {}
    for mode in MODES:
        got = [k.crash_to_step_s for k in kills if k.mode == mode]
        ok = sorted(v for v in got if v is not None)
        summary[mode] = {
            "kills": len(got),
            "recovered": len(ok),
            "p50_s": median(ok) if ok else None,
            "min_s": ok[0] if ok else None,
            "max_s": ok[-1] if ok else None,
        }
    tr = summary["torchrun"]["p50_s"]
    ratios = {
        m: (summary[m]["p50_s"] / tr if tr and summary[m]["p50_s"] is not None else None)
        for m in MODES[1:]
    }
    return {"kills": [asdict(k) for k in kills], "summary": summary, "vs_torchrun": ratios}


def render_gpt_crash(result: dict[str, Any]) -> list[str]:
    lines = [
        "5. GPT example, rank 1 of 2 SIGKILLed: crash -> first step "
        "(its last step line -> its successor's first), s"
    ]
    for mode, row in result["summary"].items():
        fig = (
            "-"
            if row["p50_s"] is None
            else f"p50 {row['p50_s']:.2f} [{row['min_s']:.2f}-{row['max_s']:.2f}]"
        )
        ratio = result["vs_torchrun"].get(mode)
        vs = "" if ratio is None else f"  ({ratio:.2f}x torchrun)"
        lines.append(f"  {mode:<12} {row['recovered']}/{row['kills']}  {fig}{vs}")
    for k in result["kills"]:
        if k["error"]:
            lines.append(f"  ! {k['mode']}: {k['error'][:160]}")
    return lines


def gpt_target(result: dict[str, Any] | None) -> dict[str, Any]:
    what = f"GPT crash -> first step in process <= {TARGET_S:g} s (p50)"
    p50 = None if result is None else result["summary"]["in-process"]["p50_s"]
    if p50 is None:
        return {"what": what, "value": "not run (--gpt-crash)", "pass": None}
    return {"what": what, "value": f"{p50:.2f} s", "pass": p50 <= TARGET_S}
