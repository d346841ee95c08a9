"""One job of the scheduling benchmark's trace (``benchmarks/scheduling.py``): it "trains" for
``--steps`` steps of ``--step-s`` seconds (a sleep), checkpoints every ``--ckpt-every``
steps (a tiny JSON file, written atomically) and, on the preemption notice, saves at once
and stops; run again, it resumes after its saved step. Only the standard library (and, under
trainpod, ``trainpod.preempted()``), so a start costs an interpreter, not torch.

    python benchmarks/workers/trace_job.py --dir DIR --steps N [--step-s 0.25]
        [--ckpt-every 8] --mode trainpod|slurm [--after-notice exit|wait]

Every rank steps; rank 0 (``RANK`` under trainpod, ``SLURM_PROCID`` under ``srun``) owns the
checkpoint ``DIR/ckpt.json`` and appends its events to ``DIR/progress.log`` (the format is in
``benchmarks/schedulingkit.py``): ``start`` (with the step it resumed from and its nodes),
``step``, ``notice``, ``saved``, ``done``.

The notice: under trainpod, ``trainpod.preempted()`` (the notice signal or file the agent
gives a preempted job); under Slurm, the signal Slurm sends a preempted job (SIGTERM, or
the ``--signal`` one with ``PreemptParameters=send_user_signal``: SIGUSR1 is trapped too).
After saving, ``--after-notice exit`` exits 0 (trainpod requeues a preempted job whatever
it exits with); ``wait`` sleeps until it is killed (a Slurm job that ended by itself during
its grace time would count as completed, not requeued).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TextIO


class Log:
    def __init__(self, out: TextIO | None, nodes: str) -> None:
        self.out = out
        self.nodes = nodes

    def line(self, kind: str, step: int) -> None:
        if self.out is None:
            return
        self.out.write(f"kind={kind} t={time.time():.6f} step={step} nodes={self.nodes}\n")
        self.out.flush()


def read_checkpoint(path: Path) -> int:
    try:
        return int(json.loads(path.read_text())["step"])
    except (FileNotFoundError, ValueError, KeyError):
        return 0


def write_checkpoint(path: Path, step: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, path)


def slurm_notice() -> Callable[[], bool]:
    got: list[int] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        got.append(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, handler)
    return lambda: bool(got)


def trainpod_notice() -> Callable[[], bool]:
    import trainpod

    trainpod.preempted()  # the first call installs the notice handler
    return lambda: trainpod.preempted()


def job_nodes(mode: str) -> str:
    if mode == "trainpod":
        return os.environ.get("TRAINPOD_NODES", "")
    from trainpod.slurm.hostlist import expand

    return ",".join(expand(os.environ.get("SLURM_JOB_NODELIST", "")))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--step-s", type=float, default=0.25)
    ap.add_argument("--ckpt-every", type=int, default=8)
    ap.add_argument("--mode", choices=("trainpod", "slurm"), required=True)
    ap.add_argument("--after-notice", choices=("exit", "wait"), default="exit")
    args = ap.parse_args()
    noticed = trainpod_notice() if args.mode == "trainpod" else slurm_notice()
    rank = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0")
    work = Path(args.dir)
    ckpt = work / "ckpt.json"
    out = None
    if rank == 0:
        work.mkdir(parents=True, exist_ok=True)
        out = (work / "progress.log").open("a")
    log = Log(out, job_nodes(args.mode))
    # Every rank resumes where rank 0 saved (ranks do not exchange anything else).
    step = read_checkpoint(ckpt)
    log.line("start", step)
    while step < args.steps:
        if noticed():
            log.line("notice", step)
            if rank == 0:
                write_checkpoint(ckpt, step)
                log.line("saved", step)
            if args.after_notice == "wait":
                while True:
                    time.sleep(1)
            return 0
        time.sleep(args.step_s)
        step += 1
        log.line("step", step)
        if rank == 0 and step % args.ckpt_every == 0:
            write_checkpoint(ckpt, step)
    log.line("done", step)
    if rank == 0:
        write_checkpoint(ckpt, step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
