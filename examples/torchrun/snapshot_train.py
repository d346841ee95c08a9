"""A plain torchrun script in the shape of PyTorch's elastic tutorial (``multinode.py``).

Run it as you would under torchrun::

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        snapshot_train.py --total-epochs 20 --save-every 2 --snapshot-dir /shared/run1

and, unchanged, under trainpod (which sets the same environment)::

    trainpod submit --nodes 2 --procs-per-node 1 --auto-resume -- \
        python snapshot_train.py --total-epochs 20 --save-every 2 --snapshot-dir /shared/run1

It knows nothing of trainpod. Rank 0 saves ``snapshot.pt`` (the model and the epochs run) in
``--snapshot-dir`` every ``--save-every`` epochs; every rank loads it at start if it is there,
so a restarted job resumes from its own newest snapshot. DDP over Gloo on CPU; the data, the
model's initial weights and the sampler's order are all seeded, and SGD without momentum has no
state of its own, so a resumed run computes exactly what an undisturbed one does: the final
loss it prints (``final loss <float.hex()>``) is the same to the bit.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def dataset(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 32, generator=g)
    w = torch.randn(32, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


class Trainer:
    def __init__(
        self, data: DataLoader[tuple[torch.Tensor, ...]], args: argparse.Namespace
    ) -> None:
        self.rank = int(os.environ["RANK"])
        self.data = data
        self.save_every = args.save_every
        self.snapshot = Path(args.snapshot_dir) / "snapshot.pt"
        self.net = model()
        self.epochs_run = 0
        if self.snapshot.exists():
            self._load_snapshot()
        self.ddp = DDP(self.net)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=args.lr)

    def _load_snapshot(self) -> None:
        snapshot = torch.load(self.snapshot, map_location="cpu")
        self.net.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"rank {self.rank}: resuming from snapshot at epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.net.state_dict(), "EPOCHS_RUN": epoch + 1}
        tmp = self.snapshot.with_suffix(".tmp")
        torch.save(snapshot, tmp)
        os.replace(tmp, self.snapshot)  # a kill mid-save leaves the previous snapshot whole
        print(f"rank {self.rank}: epoch {epoch}: snapshot saved at {self.snapshot}", flush=True)

    def _run_epoch(self, epoch: int) -> float:
        sampler = self.data.sampler
        assert isinstance(sampler, DistributedSampler)
        sampler.set_epoch(epoch)
        total = 0.0
        for x, y in self.data:
            self.opt.zero_grad()
            loss = F.mse_loss(self.ddp(x), y)
            loss.backward()
            self.opt.step()
            total += loss.item()
        return total / len(self.data)

    def train(self, total_epochs: int) -> None:
        for epoch in range(self.epochs_run, total_epochs):
            loss = self._run_epoch(epoch)
            print(f"rank {self.rank}: epoch {epoch}: loss {loss:.6f}", flush=True)
            if self.rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)

    def final_loss(self, data: TensorDataset) -> float:
        with torch.no_grad():
            x, y = data.tensors
            return float(F.mse_loss(self.net(x), y).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-epochs", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=2, help="epochs between snapshots")
    parser.add_argument("--snapshot-dir", required=True, help="where snapshot.pt is kept")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    Path(args.snapshot_dir).mkdir(parents=True, exist_ok=True)
    dist.init_process_group(backend="gloo")
    data = dataset(args.samples)
    loader = DataLoader(
        data, batch_size=args.batch_size, shuffle=False, sampler=DistributedSampler(data, seed=0)
    )
    trainer = Trainer(loader, args)
    trainer.train(args.total_epochs)
    if trainer.rank == 0:
        loss = trainer.final_loss(data)
        print(f"rank 0: final loss {loss.hex()} ({loss:.6f})", flush=True)
    # Every rank leaves the group together: a rank that destroys it while a peer still works
    # (rank 0's loss above) may hang in the teardown (pytorch/pytorch#75097; a CI run saw
    # rank 1 never exit after rank 0 had).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
