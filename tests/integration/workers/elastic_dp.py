"""A data-parallel job run by ``trainpod.elastic.run``: a small linear model, SGD with
momentum (so the optimizer's state matters), gradients all-reduced over Gloo by hand.

Each step's batch is a function of the step and the rank only, so a rolled-back step redoes
exactly what it did. Every rank writes ``<out>/rank-<r>.json`` at the end: its pid, the
final loss on a fixed probe batch, the parameters, the steps it ran and its recoveries.

``--steps N --out DIR [--step-sleep S] [--mark-at K ...] [--ddp] [--sharded] [--ckpt DIR
--ckpt-every K] [--beacon]``: with ``--ckpt`` a ``trainpod.Checkpointer`` saves every K
steps and after the last (made in ``on_group`` the first time, ``rebind()`` there after),
and the run resumes from its newest checkpoint (``resume=``). After step K the rank touches
``<out>/at-<K>-rank-<r>`` (the test waits for it before injecting a fault).
``--sharded`` tells ``elastic.run`` the state is not replicated (a replaced peer cannot be
given it). ``--beacon`` reports each step (``trainpod.report``), for the controller's hang
watchdog. Each time a group is formed the rank notes a hash of its whole state
(``group_hashes``): a replacement's equals its peers' bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainpod import elastic, report
from trainpod.ckpt import Checkpointer

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, required=True)
p.add_argument("--out", type=Path, required=True)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--mark-at", type=int, action="append", default=[])
p.add_argument("--timeout-s", type=float, default=5.0)
p.add_argument("--wait-s", type=float, default=60.0)
p.add_argument("--ddp", action="store_true", help="DistributedDataParallel, rebuilt per group")
p.add_argument("--sharded", action="store_true", help="elastic.run(replicated=False)")
p.add_argument("--ckpt", type=Path, help="checkpoint with trainpod.Checkpointer here")
p.add_argument("--ckpt-every", type=int, default=2)
p.add_argument(
    "--snapshot-every",
    default="1",
    help="elastic.run(snapshot_every=): steps, or auto (1 here: most tests count redone steps)",
)
p.add_argument("--mtbf-s", type=float, default=None, help="elastic.run(mtbf_s=)")
p.add_argument("--beacon", action="store_true", help="trainpod.report(step) after each step")
args = p.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.manual_seed(0)  # the same initial model on every rank
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
true_w = torch.arange(8, dtype=torch.float32) / 8
ran: list[int] = []
wrapped: list[torch.nn.Module] = [model]  # what the step runs: DDP(model) with --ddp


group_hashes: list[str] = []


def state_hash() -> str:
    """The bytes of every tensor of the model and the optimizer, in a fixed order."""
    h = hashlib.sha256()
    tensors = list(model.state_dict().items())
    for pid, st in sorted(opt.state_dict()["state"].items()):
        tensors += [(f"{pid}.{k}", v) for k, v in sorted(st.items()) if torch.is_tensor(v)]
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


ckpts: list[Checkpointer] = []
saves: list[int] = []


def new_group() -> None:
    """A DDP module is bound to its process group: a new group needs a new one; so does
    the Checkpointer's background work (``rebind``)."""
    group_hashes.append(state_hash())
    if args.ddp:
        wrapped[0] = torch.nn.parallel.DistributedDataParallel(model)
    if args.ckpt is not None:
        if ckpts:
            ckpts[0].rebind()
        else:
            ckpts.append(
                Checkpointer(
                    args.ckpt / "durable",
                    every=args.ckpt_every,
                    memory=args.ckpt / "shm",
                    scratch_dir=args.ckpt / "scratch",
                    timeout_s=30,
                    agent=False,
                )
            )


def resume() -> int | None:
    if not ckpts:
        return None
    loaded = ckpts[0].load_latest({"model": model, "optim": opt})
    return None if loaded is None else loaded + 1


def batch(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + r)
    x = torch.randn(16, 8, generator=g)
    return x, x @ true_w[:, None] + 0.1


def train_step(step: int) -> None:
    x, y = batch(step, rank)
    loss = torch.nn.functional.mse_loss(wrapped[0](x), y)
    opt.zero_grad()
    loss.backward()
    if not args.ddp:  # DDP averages the gradients in backward
        for param in model.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad /= world
    opt.step()
    ran.append(step)
    if ckpts and (ckpts[0].due(step) or step == args.steps - 1):
        ckpts[0].save(step, {"model": model, "optim": opt})
        saves.append(step)
    if args.beacon:
        report(step)
    if step in args.mark_at:
        (args.out / f"at-{step}-rank-{rank}").touch()
    if args.step_sleep:
        time.sleep(args.step_sleep)


result = elastic.run(
    train_step,
    {"model": model, "optim": opt},
    steps=args.steps,
    timeout_s=args.timeout_s,
    wait_s=args.wait_s,
    on_group=new_group,
    replicated=not args.sharded,
    resume=resume,
    snapshot_every="auto" if args.snapshot_every == "auto" else int(args.snapshot_every),
    mtbf_s=args.mtbf_s,
)
committed: dict[str, int | None] = {}
if ckpts:
    ckpts[0].close(60)
    committed = dict(ckpts[0].progress().committed)
# run() leaves its last group to its caller. Every rank leaves it together (a rank that
# tears Gloo down while a peer still talks to it can abort in the transport's destructor),
# and the DDP wrapper, which holds the group, goes first: else the group is destroyed at
# interpreter exit, with its threads running ("terminate called without an active
# exception", seen once in a reference run).
dist.barrier()
wrapped[0] = model
dist.destroy_process_group()
probe_x, probe_y = batch(10**6, 0)
with torch.no_grad():
    final = torch.nn.functional.mse_loss(model(probe_x), probe_y).item()
out = {
    "rank": rank,
    "pid": os.getpid(),
    "final_loss": final,
    "params": [t.flatten().tolist() for t in model.state_dict().values()],
    "ran": ran,
    "steps": result.steps,
    "generation": result.generation,
    "snapshot_every": result.snapshot_every,
    "recoveries": [dataclasses.asdict(r) for r in result.recoveries],
    "recover_file": os.environ.get("TRAINPOD_RECOVER_FILE", ""),
    "group_hashes": group_hashes,
    "node": os.environ.get("TRAINPOD_NODE", ""),
    "saves": saves,
    "committed": committed,
}
tmp = args.out / f".rank-{rank}.json.tmp"
tmp.write_text(json.dumps(out))
tmp.replace(args.out / f"rank-{rank}.json")
print(f"rank {rank} done: steps={result.steps} loss={final:.6f}", flush=True)
