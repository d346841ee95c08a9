"""A tiny DDP-style step loop for the recovery benchmark (``benchmarks/recovery.py``).

Runs unchanged under ``torchrun`` and under trainpod (both set the torchrun environment:
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT)::

    python benchmarks/workers/steps.py --steps 100000 [--ckpt-dir DIR] [--step-s 0.05]
        [--ckpt-every 10] [--no-sync] [--in-process]

Each step sleeps ``--step-s`` seconds (the "compute"), then all-reduces a small tensor over
Gloo (unless ``--no-sync``: then the ranks step independently, which is what makes a slow
rank visible as a straggler; in a synchronous job every rank runs at the slowest one's pace),
then calls ``trainpod.report(step)`` (a no-op outside trainpod). Every ``--ckpt-every`` steps
rank 0 writes ``DIR/ckpt.json`` = ``{"step": N}`` atomically and reports
``checkpoint_step``/``checkpoint_stall_s``. On start, rank 0 reads the checkpoint and
broadcasts the step to resume after, so every rank resumes at the same step.

After every step each rank appends one line to ``DIR/progress-rank<r>.log`` and prints the
same line to stdout (flushed)::

    gen=<restart count> rank=<r> pid=<pid> step=<n> t=<time.time()>

``gen`` is ``TORCHELASTIC_RESTART_COUNT`` (torchrun's restart generation; trainpod sets it to
attempt - 1), so the first line of a new generation is the first step after a restart,
measured the same way under both launchers. Three more lines split a start: ``step=-1`` when
the script starts (before ``import torch``), ``step=-2`` once torch and trainpod are
imported, ``step=-3`` once the process group is up and the resume step is agreed.

``--in-process`` runs the loop with :func:`trainpod.elastic.run` (for a job submitted with
``--recovery in-process``): a peer's fault no longer ends this rank; it re-joins the new
group and goes on from the newest step every rank holds (ADR 0026/0035). Its lines keep the
``gen`` they started with; a rank started fresh by the recovery writes ``step=-1..-3`` again.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import TextIO


def log_line(out: TextIO, gen: str, rank: int, step: int) -> None:
    line = f"gen={gen} rank={rank} pid={os.getpid()} step={step} t={time.time():.6f}\n"
    out.write(line)
    out.flush()
    print(line, end="", flush=True)


def read_checkpoint(path: Path) -> int:
    try:
        return int(json.loads(path.read_text())["step"])
    except (FileNotFoundError, ValueError, KeyError):
        return 0


def write_checkpoint(path: Path, step: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--ckpt-dir", default=os.environ.get("TRAINPOD_CHECKPOINT_DIR"))
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--no-sync", action="store_true", help="no all-reduce per step")
    ap.add_argument("--in-process", action="store_true", help="trainpod.elastic.run's loop")
    args = ap.parse_args()
    if not args.ckpt_dir:
        ap.error("no --ckpt-dir and no TRAINPOD_CHECKPOINT_DIR")
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    gen = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    progress = (ckpt_dir / f"progress-rank{rank}.log").open("a")
    log_line(progress, gen, rank, -1)

    import torch
    import torch.distributed as dist

    import trainpod

    log_line(progress, gen, rank, -2)
    if args.in_process:
        return run_in_process(args, progress, gen, rank, ckpt_dir / "ckpt.json")
    dist.init_process_group("gloo")
    ckpt = ckpt_dir / "ckpt.json"
    resume = torch.tensor([read_checkpoint(ckpt) if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(resume, src=0)
    log_line(progress, gen, rank, -3)
    buf = torch.ones(16)
    for step in range(int(resume.item()) + 1, args.steps + 1):
        time.sleep(args.step_s)
        if not args.no_sync:
            dist.all_reduce(buf)
            buf.fill_(1.0)
        log_line(progress, gen, rank, step)
        if rank == 0 and step % args.ckpt_every == 0:
            t0 = time.perf_counter()
            write_checkpoint(ckpt, step)
            stall = time.perf_counter() - t0
            trainpod.report(step, checkpoint_step=step, checkpoint_stall_s=stall)
        else:
            trainpod.report(step)
    progress.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_in_process(
    args: argparse.Namespace, progress: TextIO, gen: str, rank: int, ckpt: Path
) -> int:
    """The same steps under ``trainpod.elastic.run``: the state every rank holds is the
    all-reduced buffer; the step to resume after comes from the checkpoint file, as above."""
    import torch
    import torch.distributed as dist

    import trainpod
    from trainpod import elastic

    class Buffer:
        def __init__(self) -> None:
            self.buf = torch.ones(16)

        def state_dict(self) -> dict[str, torch.Tensor]:
            return {"buf": self.buf}

        def load_state_dict(self, sd: dict[str, torch.Tensor], /) -> None:
            self.buf.copy_(sd["buf"])

    state = Buffer()

    def step_fn(step: int) -> None:
        time.sleep(args.step_s)
        dist.all_reduce(state.buf)
        state.buf.fill_(1.0)
        log_line(progress, gen, rank, step)
        if rank == 0 and step % args.ckpt_every == 0:
            t0 = time.perf_counter()
            write_checkpoint(ckpt, step)
            stall = time.perf_counter() - t0
            trainpod.report(step, checkpoint_step=step, checkpoint_stall_s=stall)
        else:
            trainpod.report(step)

    marked: list[bool] = []

    def on_group() -> None:
        if not marked:  # the first group: as init_process_group + resume above
            marked.append(True)
            log_line(progress, gen, rank, -3)

    start = read_checkpoint(ckpt) + 1  # every rank reads the same file (shared dir)
    elastic.run(
        step_fn,
        {"buf": state},
        steps=args.steps + 1,
        start_step=start,
        timeout_s=10.0,
        on_group=on_group,
    )
    progress.close()
    dist.barrier()  # run() leaves its last group to its caller
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
