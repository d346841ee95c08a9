"""Part 4 of the recovery benchmark: full restart vs in-process recovery, side by side.

The same worker (``benchmarks/workers/steps.py``; with ``--in-process`` its loop is
``trainpod.elastic.run``), the same 2 x 1 job on ``main`` (2 workers + 1 hot spare), the same
injections in the same order: ``kill-worker`` into rank 1 (a crash: in process, the rank
starts again on its node) and ``kill-agent`` into rank 1's node (a lost node: in process,
its rank starts on the spare and takes its state from rank 0, ADR 0035). One job per mode
and fault; ``repeats`` injections each, the next one once the job steps again.

Per injection: *fault -> every rank stepping* (from the killed rank's last step line to the
latest of each rank's first step line after its stall: under a full restart those come
from the new attempt, in process the healthy rank's from the re-formed group; GAP_S), and
what trainpod recorded (a new attempt, or an
``in_process_recovery_done`` and its ``duration_s``). CPU and Gloo only.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recoverykit.common import (
    MAIN_GROUPS,
    POOL_TIMEOUT_S,
    RECOVERY_TIMEOUT_S,
    START_TIMEOUT_S,
    WARM_S,
    JobWatch,
    all_idle,
    end_job,
    median,
    node_of_rank,
    read_progress,
    steps_spec,
    wait_until,
)
from trainpod.api.models import ChaosFault, ChaosRequest
from trainpod.client.http import TrainpodClient

MODES = ("restart", "in-process")
FAULTS: tuple[ChaosFault, ...] = ("kill-worker", "kill-agent")


@dataclass
class Sample:
    mode: str
    fault: ChaosFault
    node: str
    injected_at: float
    stepping_s: float | None = None  # injection -> every rank has stepped again
    attempts: int = 0  # the job's attempts after it
    in_process_s: float | None = None  # in_process_recovery_done's duration_s
    error: str = ""


GAP_S = 0.3  # a rank's stall: 6 steps of steps.py without a line


def _stepping(ckpt: Path, ranks: int, injected_at: float) -> float | None:
    """Seconds from the fault (the killed rank 1's last step line: the chaos order runs a
    beat after it is queued) to every rank having stepped again (each rank's first line
    after the fault that ends a stall of at least GAP_S); None until rank 1 runs again."""
    lines = [x for x in read_progress(ckpt) if x.step >= 0]
    before = [x for x in lines if x.rank == 1 and x.t <= injected_at]
    if not before:
        return None
    old = before[-1].pid
    if not any(x.rank == 1 and x.pid != old and x.t > injected_at for x in lines):
        return None  # rank 1 has not stepped again (under a new pid) yet
    fault = max(x.t for x in lines if x.rank == 1 and x.pid == old)
    firsts: list[float] = []
    for r in range(ranks):
        mine = sorted(x.t for x in lines if x.rank == r)
        again = [t for prev, t in itertools.pairwise(mine) if t > fault and t - prev >= GAP_S]
        if not again:
            return None
        firsts.append(again[0])
    return max(firsts) - fault


def run_mode(
    client: TrainpodClient, mode: str, fault: ChaosFault, repeats: int, workdir: Path
) -> list[Sample]:
    label = f"{mode}-{fault}"
    ckpt = workdir / f"steps-{label}"
    spec = steps_spec(f"recovery-{label}", ckpt, workdir)
    if mode == "in-process":
        spec = spec.model_copy(
            update={"recovery": "in-process", "command": [*spec.command, "--in-process"]}
        )
    job = client.submit(spec)
    watch = JobWatch(client, job.id)
    out: list[Sample] = []
    try:
        watch.wait_beacon_after(0, START_TIMEOUT_S)
        for _ in range(repeats):
            held = frozenset(client.job(job.id).attempts[-1].nodes)
            wait_until(
                lambda h=held: all_idle(client, MAIN_GROUPS, h),  # type: ignore[misc]
                POOL_TIMEOUT_S,
                "a free spare",
            )
            time.sleep(WARM_S)
            node, _ = node_of_rank(client, job.id, rank=1)
            s = Sample(mode, fault, node, time.time())
            out.append(s)
            rank = 1 if fault == "kill-worker" else None
            client.chaos(ChaosRequest(node=node, fault=fault, rank=rank))
            try:
                s.stepping_s = wait_until(
                    lambda s=s: _stepping(ckpt, 2, s.injected_at),  # type: ignore[misc]
                    RECOVERY_TIMEOUT_S,
                    f"{label}: every rank stepping again",
                )
            except TimeoutError as exc:
                s.error = str(exc)
                break
            watch.poll()
            s.attempts = len(client.job(job.id).attempts)
            done = [e for e in watch.all("in_process_recovery_done") if e.ts > s.injected_at]
            s.in_process_s = done[0].data.get("duration_s") if done else None
    finally:
        end_job(client, job.id)
    return out


def run_side_by_side(client: TrainpodClient, repeats: int, workdir: Path) -> dict[str, Any]:
    samples = [
        s
        for fault in FAULTS
        for mode in MODES
        for s in run_mode(client, mode, fault, repeats, workdir)
    ]
    table: dict[str, Any] = {}
    for fault in FAULTS:
        for mode in MODES:
            got = [s.stepping_s for s in samples if (s.mode, s.fault) == (mode, fault)]
            ok = [v for v in got if v is not None]
            table[f"{fault}/{mode}"] = {
                "injections": len(got),
                "recovered": len(ok),
                "stepping_p50_s": median(ok) if ok else None,
                "stepping_max_s": max(ok) if ok else None,
            }
    return {"samples": [asdict(s) for s in samples], "summary": table}


def render_side_by_side(result: dict[str, Any]) -> list[str]:
    lines = ["full restart vs in-process (fault -> every rank stepping again, s):"]
    for key, row in result["summary"].items():
        p50, most = row["stepping_p50_s"], row["stepping_max_s"]
        fig = "-" if p50 is None else f"p50 {p50:.2f}  max {most:.2f}"
        lines.append(f"  {key:<24} {row['recovered']}/{row['injections']}  {fig}")
    return lines
