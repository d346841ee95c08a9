"""An unmodified torchrun script: reads only torchrun's variables, inits with env://."""

import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group(backend="gloo", init_method="env://")
    assert os.environ["TORCHELASTIC_RUN_ID"]
    assert (
        int(os.environ["GROUP_RANK"]) * int(os.environ["LOCAL_WORLD_SIZE"]) + local_rank
        == dist.get_rank()
    )
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = model.module.weight.detach().clone()
    gathered = [torch.zeros_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, w)
    assert all(torch.equal(g, w) for g in gathered), "DDP replicas diverged"
    print(f"torchrun-style rank {dist.get_rank()} done", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13's Gloo teardown at interpreter exit occasionally aborts ("terminate called
    # without an active exception", SIGABRT) after the work is done; leave without it.
    sys.stdout.flush()
    os._exit(0)
