"""Megatron's ``--ckpt-format torch_dist`` checkpoints: ``iter_NNNNNNN/`` and its tracker.

``--save`` holds one ``torch.distributed.checkpoint`` directory per saved iteration and
``latest_checkpointed_iteration.txt``, which rank 0 rewrites (atomically) only after every
rank has written its shards: a kill mid-save leaves the previous iteration the latest.
``--load`` reads the tracker and loads that iteration in place. TP shards are saved as
DTensors (``mpu.sharded``): each written once, not once per DP replica, with its offset in the
full tensor, so a checkpoint loads at another TP, PP or DP size. Every call is collective.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

import mpu
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's name


def state_dict(model: nn.Module, opt: torch.optim.AdamW, ps: mpu.ParallelState) -> dict[str, Any]:
    """Model and AdamW state keyed by parameter name; TP shards as DTensors. A parameter the
    optimizer has not stepped yet gets zero moments (what a load fills in)."""
    sd: dict[str, Any] = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p) or {
            "step": torch.zeros(()),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
        opt.state[p] = st
        sd[f"model.{name}"] = mpu.sharded(p.data, p, ps)
        sd[f"optim.{name}.exp_avg"] = mpu.sharded(st["exp_avg"], p, ps)
        sd[f"optim.{name}.exp_avg_sq"] = mpu.sharded(st["exp_avg_sq"], p, ps)
        sd[f"optim.{name}.step"] = st["step"]
    return sd


def save_checkpoint(
    it: int,
    model: nn.Module,
    opt: torch.optim.AdamW,
    args: argparse.Namespace,
    ps: mpu.ParallelState,
) -> None:
    root = Path(args.save)
    path = root / f"iter_{it:07d}"
    if ps.rank == 0 and path.exists():  # what a save cut short left behind
        shutil.rmtree(path)
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state_dict(model, opt, ps) | {"iteration": it}, checkpoint_id=str(path))
    dist.barrier()  # every rank's shards are written: now it is the latest
    if ps.rank == 0:
        tmp = root / (TRACKER + ".tmp")
        tmp.write_text(str(it))
        os.replace(tmp, root / TRACKER)
        took = time.perf_counter() - t0
        print(f"  successfully saved checkpoint at iteration {it:7d} to {root} ({took:.2f} s)")


def load_checkpoint(
    model: nn.Module, opt: torch.optim.AdamW, args: argparse.Namespace, ps: mpu.ParallelState
) -> int:
    """The iteration ``--load``'s tracker names, loaded in place; 0 when there is none."""
    if not args.load or not (Path(args.load) / TRACKER).is_file():
        if ps.rank == 0:
            print(f"could not find {TRACKER} in {args.load}; training from random init")
        return 0
    it = int((Path(args.load) / TRACKER).read_text().strip())
    path = Path(args.load) / f"iter_{it:07d}"
    if ps.rank == 0:
        print(f" loading checkpoint from {args.load} at iteration {it}")
    sd = state_dict(model, opt, ps) | {"iteration": 0}
    dcp.load(sd, checkpoint_id=str(path))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(mpu.local(sd[f"model.{name}"]))
            st = opt.state[p]
            st["exp_avg"].copy_(mpu.local(sd[f"optim.{name}.exp_avg"]))
            st["exp_avg_sq"].copy_(mpu.local(sd[f"optim.{name}.exp_avg_sq"]))
            st["step"].copy_(sd[f"optim.{name}.step"])
    if sd["iteration"] != it:
        raise SystemExit(f"{path} says iteration {sd['iteration']}, its name {it}")
    if ps.rank == 0:
        print(f"  successfully loaded checkpoint from {args.load} at iteration {it}")
    return it
