"""A small deterministic DDP (Gloo) "training" loop for the self-healing tests.

argv: --steps N --ckpt-every K [--ckpt-dir DIR] [--step-s S] [--sync-every M]
[--fail-at STEP [--fail-first RANK|rotate] [--abort-on-attempt A]] [--tensorboard]
[--teardown-abort-rank R] [--teardown-hang-rank R]

``--tensorboard``: rank 0 also writes ``value`` per step with torch's own ``SummaryWriter``
into ``$TRAINPOD_TENSORBOARD_DIR/script`` (``purge_step`` = the resumed step; flushed at each
checkpoint), as a user's script would.

Every step sleeps ``S`` seconds ("compute"), then every ``M`` steps (default: every step)
all-reduces a tensor, so a killed or stopped peer stalls or fails the others as real
training does. Each rank reports each step with ``trainpod.report`` (``value`` and
``loss`` = 1 / step) and appends
``attempt=<TRAINPOD_ATTEMPT> step=<s>`` to ``progress-rank<r>.log`` in the checkpoint dir.
Every K steps rank 0 writes ``ckpt-<step>.json`` = ``{"step", "value", "attempt"}`` atomically
(tmp + os.replace) and reports ``checkpoint_step``. On start rank 0 loads the newest
checkpoint and broadcasts where to resume, and every rank writes
``attempt=<a> resume=<step>`` to its progress file. At the end: ``done steps=N value=V``
and exit 0.

``--fail-at STEP``: a user error, the same every time: every rank raises
``RuntimeError: bad batch at step STEP`` there, rank ``--fail-first`` (default 0; ``rotate``:
rank ``(attempt - 1) % world``) at once and the others a second later, so which rank fails
first is known. ``--abort-on-attempt A``: on attempt A every rank that raises then aborts
(SIGABRT) in its interpreter's teardown, after its traceback is printed, as a Gloo or NCCL
script that never destroyed its process group may (pytorch/pytorch#179291).
``--teardown-abort-rank R``: after a finished run rank R dies as such a script may in its
teardown, at once (libstdc++'s ``terminate called without an active exception``, then
SIGABRT: the message and the abort are this script's, the race in Gloo is not reproduced),
while the other ranks take a second more to exit 0.
``--teardown-hang-rank R``: after a finished run rank R never exits, idle (blocked on a lock
forever after destroying its group, as ``destroy_process_group`` may hang when its peer has
already gone, pytorch/pytorch#75097); the other ranks exit 0.

``value`` is the sum over steps s of the all-reduced ``(rank + 1) * s``; with a fixed world
size W it ends at ``W (W + 1) / 2 * N (N + 1) / 2`` whatever the restarts, when no step is
lost or done twice after a resume.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import trainpod


def newest_checkpoint(d: Path) -> dict[str, float] | None:
    found = sorted(
        (int(m.group(1)), p)
        for p in d.glob("ckpt-*.json")
        if (m := re.match(r"ckpt-(\d+)\.json$", p.name))
    )
    return json.loads(found[-1][1].read_text()) if found else None


def save(d: Path, step: int, value: float, attempt: str) -> None:
    final = d / f"ckpt-{step:06d}.json"
    tmp = d / f".ckpt-{step:06d}.json.tmp"
    tmp.write_text(json.dumps({"step": step, "value": value, "attempt": int(attempt)}))
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt-every", type=int, required=True)
    ap.add_argument("--ckpt-dir", default=os.environ.get("TRAINPOD_CHECKPOINT_DIR"))
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--sync-every", type=int, default=1)
    ap.add_argument("--fail-at", type=int, default=None)
    ap.add_argument("--fail-first", default="0")
    ap.add_argument("--abort-on-attempt", type=int, default=None)
    ap.add_argument("--tensorboard", action="store_true")
    ap.add_argument("--teardown-abort-rank", type=int, default=None)
    ap.add_argument("--teardown-hang-rank", type=int, default=None)
    args = ap.parse_args()
    assert args.ckpt_dir, "no --ckpt-dir and no TRAINPOD_CHECKPOINT_DIR"
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    attempt = os.environ.get("TRAINPOD_ATTEMPT", "0")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    progress = open(ckpt_dir / f"progress-rank{rank}.log", "a", buffering=1)  # noqa: SIM115

    # rank 0 decides where to resume; everyone agrees
    state = torch.zeros(2, dtype=torch.float64)
    if rank == 0 and (ckpt := newest_checkpoint(ckpt_dir)) is not None:
        state = torch.tensor([float(ckpt["step"]), float(ckpt["value"])], dtype=torch.float64)
    dist.broadcast(state, src=0)
    start, value = int(state[0].item()) + 1, float(state[1].item())
    progress.write(f"attempt={attempt} resume={start}\n")
    print(f"rank {rank}/{world} attempt {attempt}: resuming at step {start}", flush=True)

    writer = None
    if args.tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        tb = Path(os.environ["TRAINPOD_TENSORBOARD_DIR"]) / "script"
        writer = SummaryWriter(str(tb), purge_step=start, flush_secs=1)

    pending: list[torch.Tensor] = []
    for step in range(start, args.steps + 1):
        if args.fail_at is not None and step == args.fail_at:
            rotate = args.fail_first == "rotate"
            first = (int(attempt) - 1) % world if rotate else int(args.fail_first)
            if rank != first:
                time.sleep(1.0)
            if args.abort_on_attempt == int(attempt):
                atexit.register(os.abort)  # after the excepthook printed the traceback
            raise RuntimeError(f"bad batch at step {step}")
        time.sleep(args.step_s)
        pending.append(torch.tensor([float((rank + 1) * step)], dtype=torch.float64))
        saved = False
        if step % args.sync_every == 0 or step == args.steps:
            batch = torch.cat(pending)
            dist.all_reduce(batch)
            value += float(batch.sum().item())
            pending = []
            # everything up to here is in `value`: a checkpoint may cover it
            if step % args.ckpt_every == 0 and rank == 0:
                save(ckpt_dir, step, value, attempt)
                saved = True
        progress.write(f"attempt={attempt} step={step}\n")
        if writer is not None:
            writer.add_scalar("value", value, step)
            if saved:  # what a checkpoint covers is on disk too (a teardown kills unflushed)
                writer.flush()
        if saved:
            trainpod.report(step, value=value, loss=1.0 / step, checkpoint_step=step)
        else:
            trainpod.report(step, value=value, loss=1.0 / step)

    if writer is not None:
        writer.close()
    print(f"done steps={args.steps} value={value:.0f}", flush=True)
    progress.close()
    dist.barrier()
    if args.teardown_abort_rank == rank:
        sys.stderr.write("terminate called without an active exception\n")
        sys.stderr.flush()
        os.abort()
    dist.destroy_process_group()
    if args.teardown_hang_rank == rank:
        print("stuck in teardown", flush=True)
        threading.Event().wait()
    if args.teardown_abort_rank is not None:
        time.sleep(1.0)  # the aborted rank is reported first: the controller must wait
    sys.exit(0)


if __name__ == "__main__":
    main()
