"""Every rank checks the torchrun environment contract, then all-reduces over Gloo."""

import os
import sys

import torch
import torch.distributed as dist

env = {
    k: os.environ[k]
    for k in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TRAINPOD_JOB_ID",
        "TRAINPOD_ATTEMPT",
        "TRAINPOD_SHARED_DIR",
        "TRAINPOD_SCRATCH_DIR",
        "TRAINPOD_CHECKPOINT_URI",
        "TRAINPOD_NODE",
    )
}
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == int(env["WORLD_SIZE"]), (world, env)
assert rank == int(env["RANK"])
local_world = int(env["LOCAL_WORLD_SIZE"])
assert rank == int(env["GROUP_RANK"]) * local_world + int(env["LOCAL_RANK"])
t = torch.tensor([float(rank)])
dist.all_reduce(t)
assert t.item() == world * (world - 1) / 2, t
print(
    f"ok rank={rank} world={world} sum={t.item()} node={env['TRAINPOD_NODE']} "
    f"scratch={env['TRAINPOD_SCRATCH_DIR']} job={env['TRAINPOD_JOB_ID']}",
    flush=True,
)
dist.barrier()
dist.destroy_process_group()
sys.exit(0)
