"""Part 2 of the recovery benchmark: the same crash under torchrun --max-restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from recoverykit.common import (
    RECOVERY_TIMEOUT_S,
    START_TIMEOUT_S,
    STEP_S,
    STEPS,
    TORCHRUN_MAX_RESTARTS,
    WARM_S,
    StepLine,
    _diff,
    gen_first_step,
    read_progress,
    split_start,
    wait_until,
)
from trainpod.cli.jobs import default_env


# -- 2. torchrun ------------------------------------------------------------------------------
@dataclass
class TorchrunSample:
    run: int
    gen: int  # the generation started by the restart
    killed_pid: int
    killed_at: float
    split: dict[str, float | None] = field(default_factory=dict)  # SPLIT, from killed_at
    first_step_at: float | None = None
    kill_to_first_step_s: float | None = None
    error: str = ""


class Torchrun:
    """One ``torchrun --standalone`` run of steps.py in its own session (``script``: another
    script and its arguments instead; its progress lines go to ``ckpt``)."""

    def __init__(self, ckpt: Path, log: Path, script: list[str] | None = None) -> None:
        self.ckpt = ckpt
        ckpt.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "TORCH"))}
        env.update(default_env(), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        # torch 2.13's torchrun shares one TCP store across restarts and its workers add no
        # per-attempt prefix (rendezvous._create_c10d_store), so a restarted generation can
        # read the dead one's Gloo addresses: connectFullMesh "Connection refused", every
        # restart failing (seen here). Its documented opt-out gives each round a fresh store.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            str(TORCHRUN_MAX_RESTARTS),
            *(script or [str(STEPS), "--ckpt-dir", str(ckpt), "--step-s", str(STEP_S)]),
        ]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=ckpt,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM torchrun's group (it stops its workers), then SIGKILL it and every worker
        it ever started (the workers run in sessions of their own)."""
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=15)
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for pid in {x.pid for x in read_progress(self.ckpt)}:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _warm_rank(ckpt: Path, gen: int, rank: int) -> StepLine | None:
    """The latest line of ``rank`` in ``gen``, once that generation has stepped ~WARM_S."""
    lines = [x for x in read_progress(ckpt) if x.gen == gen and x.step >= 0]
    first = min((x.t for x in lines), default=None)
    mine = [x for x in lines if x.rank == rank]
    if first is None or not mine or mine[-1].t - first < WARM_S:
        return None
    return mine[-1]


def run_torchrun(repeats: int, workdir: Path) -> list[TorchrunSample]:
    """``repeats`` SIGKILLs of rank 1 under torchrun; kill -> first step of the next gen."""
    samples: list[TorchrunSample] = []
    log = workdir / "torchrun.log"
    run: Torchrun | None = None
    runs = gen = 0
    try:
        while len(samples) < repeats:
            if run is None or gen >= TORCHRUN_MAX_RESTARTS or not run.alive():
                if run is not None:
                    run.stop()
                runs += 1
                run = Torchrun(workdir / f"torchrun-{runs}", log)
                gen = 0
            ckpt = run.ckpt
            g = gen
            try:
                line = wait_until(
                    lambda c=ckpt, g=g: _warm_rank(c, g, 1),  # type: ignore[misc]
                    START_TIMEOUT_S,
                    f"torchrun generation {g} to step",
                )
            except TimeoutError as exc:
                samples.append(TorchrunSample(runs, gen, 0, time.time(), error=str(exc)))
                break
            killed_at = time.time()
            os.kill(line.pid, signal.SIGKILL)
            sample = TorchrunSample(run=runs, gen=gen + 1, killed_pid=line.pid, killed_at=killed_at)
            samples.append(sample)
            try:
                wait_until(
                    lambda c=ckpt, g=g: gen_first_step(read_progress(c), g + 1),  # type: ignore[misc]
                    RECOVERY_TIMEOUT_S,
                    f"torchrun generation {g + 1} to step",
                )
            except TimeoutError as exc:
                sample.error = str(exc)
                run.stop()
                run = None
                continue
            lines = read_progress(ckpt)
            sample.split = split_start(lines, g + 1, killed_at)
            sample.first_step_at = gen_first_step(lines, g + 1)
            sample.kill_to_first_step_s = _diff(sample.first_step_at, killed_at)
            gen += 1
    finally:
        if run is not None:
            run.stop()
    return samples
