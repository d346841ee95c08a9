"""Part 3 of the recovery benchmark: goodput of a chaos run of the GPT example."""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recoverykit.common import (
    CHAOS_END_GRACE_S,
    CHAOS_FAULTS,
    CHAOS_STEP_MARGIN,
    CKPT_TARGET_S,
    ENDED,
    GPT,
    HANG_TIMEOUT_S,
    JobWatch,
    _count,
    end_job,
    median,
    wait_until,
)
from trainpod.api.models import ChaosFault, ChaosRequest, EventInfo, JobInfo
from trainpod.cli.jobs import default_env
from trainpod.client.http import TrainpodClient
from trainpod.errors import Conflict
from trainpod.spec.job import JobSpec
from trainpod.telemetry.goodput import compute_goodput


# -- 3. goodput of a chaos run ----------------------------------------------------------------
def gpt_spec(
    name: str,
    ckpt: Path,
    workdir: Path,
    steps: int,
    ckpt_every: int | str,
    recovery: str = "restart",
) -> JobSpec:
    """``recovery``: ``restart`` (every rank starts again after a fault) or ``in-process``
    (the healthy ranks stay: ADR 0026, 0046)."""
    # In process, a peer that hangs is replaced once the others' collectives time out:
    # as soon as the watchdog's hang_timeout_s here (ADR 0026, hangs).
    timeout = ["--collective-timeout-s", str(HANG_TIMEOUT_S)] if recovery == "in-process" else []
    return JobSpec(
        command=[
            sys.executable,
            str(GPT),
            "--steps",
            str(steps),
            "--ckpt-every",
            str(ckpt_every),
            "--ckpt-dir",
            str(ckpt),
            "--log-every",
            "50",
            *timeout,
        ],
        name=name,
        nodes=2,
        procs_per_node=1,
        partition="main",
        env=default_env(),
        workdir=str(workdir),
        auto_resume=True,
        max_restarts=100,
        recovery=recovery,
    )


def calibrate_gpt(client: TrainpodClient, workdir: Path, tag: str = "") -> dict[str, Any]:
    """A short fault-free GPT job: step time, checkpoint stall per save, start-up."""
    steps, every = 60, 20
    job = client.submit(
        gpt_spec("recovery-gpt-calibration", workdir / f"gpt-cal{tag}", workdir, steps, every)
    )
    watch = JobWatch(client, job.id)
    try:
        wait_until(lambda: client.job(job.id).state in ENDED, 300.0, "the calibration job")
    finally:
        end_job(client, job.id)
    watch.poll()
    info = client.job(job.id)
    prog = watch.find("attempt_progress", attempt=1)
    if info.state != "completed" or prog is None or not prog.data.get("step_time_s"):
        raise RuntimeError(f"GPT calibration job {job.id} {info.state}: {info.reason[:300]}")
    saves = steps // every
    return {
        "job_id": job.id,
        "steps": steps,
        "step_time_s": float(prog.data["step_time_s"]),
        "checkpoint_stall_per_save_s": float(prog.data.get("checkpoint_stall_s") or 0) / saves,
        "wall_s": (info.ended_at or 0) - info.submitted_at,
    }


@dataclass
class ChaosFaultRecord:
    fault: str
    node: str
    planned_at_s: float  # since the job's submit
    injected_at_s: float | None = None
    skipped: str = ""


def pick_fault(rng: random.Random, previous: str | None) -> ChaosFault:
    """A random fault, never the previous one again (see the module docstring)."""
    return rng.choice([f for f in CHAOS_FAULTS if f != previous])


def chaos_ckpt_every(value: str, step_s: float) -> int | str:
    """``--chaos-ckpt-every``: ``auto`` (the Checkpointer's Young/Daly interval), ``sized``
    (about one save per CKPT_TARGET_S of training at the calibrated step time) or N steps."""
    if value == "sized":
        return max(1, round(CKPT_TARGET_S / step_s))
    return value if value == "auto" else int(value)


def run_chaos(
    client: TrainpodClient,
    workdir: Path,
    minutes: float,
    fault_every_s: float,
    seed: int,
    ckpt: str = "auto",
    recovery: str = "restart",
    run: int = 0,
) -> dict[str, Any]:
    """The GPT job under seeded faults for ``minutes``, then its goodput and the model.

    ``--steps`` is sized for CHAOS_STEP_MARGIN x ``minutes`` at the calibrated step time
    (the pace follows the machine's load, which others share), and the job is cancelled once
    ``minutes`` have passed and it is running again; if it completes earlier, so be it."""
    tag = f"-{recovery}" + (f"-{run}" if run else "")  # each run its own dirs: none resumes
    cal = calibrate_gpt(client, workdir, tag)
    step_s = cal["step_time_s"]
    steps = max(100, int(CHAOS_STEP_MARGIN * minutes * 60 / step_s))
    ckpt_every = chaos_ckpt_every(ckpt, step_s)
    rng = random.Random(seed)
    job = client.submit(
        gpt_spec(
            "recovery-gpt-chaos",
            workdir / f"gpt-chaos{tag}",  # its own: a second run must not resume it
            workdir,
            steps,
            ckpt_every,
            recovery,
        )
    )
    t0 = time.monotonic()
    end_at = minutes * 60
    watch = JobWatch(client, job.id)
    faults: list[ChaosFaultRecord] = []
    previous: str | None = None
    next_at = rng.uniform(0.5, 1.5) * fault_every_s
    stopped = ""
    try:
        while True:
            info = client.job(job.id)
            elapsed = time.monotonic() - t0
            if info.state in ENDED:
                break
            if elapsed < min(next_at, end_at):
                time.sleep(0.5)
                continue
            # Only while it runs: the latest attempt has beaconed, its ranks are up.
            watch.poll()
            attempt = info.attempts[-1].number if info.attempts else 0
            running = info.state == "running" and watch.find("first_beacon", attempt=attempt)
            if elapsed >= end_at and (running or elapsed > end_at + CHAOS_END_GRACE_S):
                stopped = f"cancelled by the benchmark after {elapsed:.0f} s"
                break
            if not running:
                time.sleep(0.2)
                continue
            fault = pick_fault(rng, previous)
            node = rng.choice(sorted(info.attempts[-1].nodes))
            rec = ChaosFaultRecord(fault=fault, node=node, planned_at_s=next_at)
            try:
                client.chaos(ChaosRequest(node=node, fault=fault))
                rec.injected_at_s = time.monotonic() - t0
                previous = fault
            except Conflict as exc:
                rec.skipped = str(exc)
            faults.append(rec)
            # The next gap counts from now: a fault delayed by a recovery does not bunch up.
            next_at = time.monotonic() - t0 + rng.uniform(0.5, 1.5) * fault_every_s
    finally:
        if client.job(job.id).state not in ENDED:
            end_job(client, job.id)
    info = client.job(job.id)
    events = client.events(job_id=job.id)
    report = compute_goodput(info, events, time.time())
    out = chaos_results(info, events, report.to_dict(), cal, steps, ckpt_every, faults)
    out["stopped"] = stopped
    out["recovery"] = recovery
    out["ok"] = info.state == "completed" or (bool(stopped) and info.state == "cancelled")
    return out


def chaos_results(
    info: JobInfo,
    events: list[EventInfo],
    gp: dict[str, Any],
    cal: dict[str, Any],
    steps: int,
    ckpt_every: int | str,
    faults: list[ChaosFaultRecord],
) -> dict[str, Any]:
    b = gp["buckets"]
    n_faults = len(gp["faults"])
    progress = [e for e in events if e.kind == "attempt_progress"]
    stall = sum(float(e.data.get("checkpoint_stall_s") or 0.0) for e in progress)
    step_times = [float(e.data["step_time_s"]) for e in progress if e.data.get("step_time_s")]
    step_s = median(step_times) if step_times else cal["step_time_s"]
    if isinstance(ckpt_every, int):
        saves = sum(_saves(e.data, ckpt_every) for e in progress)
        tau = ckpt_every * step_s
    else:  # auto: the saves are the memory-tier commits; tau their mean spacing in training
        saves = sum(1 for e in events if e.kind == "checkpoint_saved")
        ran = sum(_steps_run(e.data) for e in progress)
        tau = ran * step_s / saves if saves else 0.0
    delta = stall / saves if saves else cal["checkpoint_stall_per_save_s"]
    wall = gp["wall_s"]
    fixed = ("detection", "teardown", "restart", "waiting_for_spare", "reload")
    model: dict[str, Any] = {"delta_s": delta, "tau_s": tau, "saves": saves}
    # The model has no first start-up and no final shutdown; the measured ETTR has both.
    span = wall - b["queued"] - b["startup"] - b["shutdown"]
    model["ettr_measured_without_startup_shutdown"] = b["productive"] / span if span > 0 else 0.0
    if n_faults:
        m = wall / n_faults
        r = sum(b[k] for k in fixed) / n_faults
        optimal = 1 - math.sqrt(2 * delta / m) - r / m
        actual_tau = 1 - delta / tau - (r + tau / 2) / m if tau > 0 else 0.0
        model.update(
            M_s=m,
            R_s=r,
            R_parts_s={k: b[k] / n_faults for k in fixed},
            ettr_model=optimal,
            ettr_model_actual_tau=actual_tau,
            tau_optimal_s=math.sqrt(2 * delta * m),
            diff_points=100 * (gp["ettr"] - optimal),
            diff_points_actual_tau=100 * (gp["ettr"] - actual_tau),
            within_3_points=abs(gp["ettr"] - optimal) <= 0.03,
            within_3_points_actual_tau=abs(gp["ettr"] - actual_tau) <= 0.03,
        )
    return {
        "job_id": info.id,
        "state": info.state,
        "steps": steps,
        "ckpt_every": ckpt_every,
        "calibration": cal,
        "step_time_s": step_s,
        "wall_s": wall,
        "productive_s": b["productive"],
        "goodput": gp["goodput"],
        "ettr": gp["ettr"],
        "lost_by_cause_s": gp["lost_by_cause"],
        "faults_detected": n_faults,
        "faults_by_kind": _count(f["fault"] for f in gp["faults"]),
        "faults_classified": _count(classified_faults(events).values()),
        "injected": [asdict(f) for f in faults],
        "attempts": len(info.attempts),
        # The cross-check goodput cannot make: steps reached in the wall time, against what
        # the calibrated step time would give without a fault (goodput counts beaconing
        # time as productive, whatever a step cost).
        "last_step": max((a.get("last_step") or 0 for a in gp["attempts"]), default=0),
        "steps_fault_free": int(wall / cal["step_time_s"]) if cal["step_time_s"] else 0,
        "model": model,
        "notes": gp["notes"],
        "goodput_report": gp,
    }


def classified_faults(events: list[EventInfo]) -> dict[int, str]:
    """Attempt -> its fault's kind: fault_detected's, or fault_classified's when it came."""
    kinds: dict[int, str] = {}
    for e in events:
        if e.attempt is None or e.kind not in ("fault_detected", "fault_classified"):
            continue
        if e.kind == "fault_classified" or e.attempt not in kinds:
            kinds[e.attempt] = str(e.data.get("fault"))
    return kinds


def _steps_run(progress: dict[str, Any]) -> int:
    first, last = progress.get("first_step"), progress.get("last_step")
    if first is None or last is None:
        return 0
    return max(0, int(last) - int(first) + 1)


def _saves(progress: dict[str, Any], every: int) -> int:
    first, last = progress.get("first_step"), progress.get("last_step")
    if first is None or last is None:
        return 0
    return max(0, int(last) // every - (int(first) - 1) // every)
