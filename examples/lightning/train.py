"""A plain PyTorch Lightning script, written for Lightning's own launcher or torchrun.

Nothing in it knows trainpod. Run it under trainpod unchanged::

    trainpod submit --nodes 2 --auto-resume -- \\
        python -m trainpod.integrations.lightning examples/lightning/train.py --ckpt-dir ckpts

``python -m trainpod.integrations.lightning`` runs the script as ``python`` would, and hands
Lightning the newest verified ``last.ckpt`` of the script's own ``ModelCheckpoint`` as
``fit(ckpt_path=...)`` after a restart (see README, "PyTorch Lightning"). Or by itself, as
for torchrun::

    torchrun --nnodes 2 --nproc-per-node 1 ... examples/lightning/train.py --ckpt-dir ckpts

A tiny regression model on generated data (nothing is downloaded); deterministic
(``seed_everything``, ``deterministic=True``, a seeded ``DistributedSampler``), so a run that
resumes from a checkpoint ends with exactly the loss of an undisturbed one. An epoch is
``--batches-per-epoch`` steps and checkpoints fall on epoch ends, where Lightning's resume is
exact even for a plain (not stateful) DataLoader. ``--step-time`` stands in for a heavier
model: each step also sleeps that long. The final loss is printed as ``final_loss=...``.
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self, step_time: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.step_time = step_time

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        if self.step_time:
            time.sleep(self.step_time)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data(world_batches: int, batch_size: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(world_batches * batch_size, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) ** 2) / 4
    return TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", required=True, help="where ModelCheckpoint writes")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--batches-per-epoch", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds slept per step")
    args = p.parse_args()

    pl.seed_everything(7, workers=True)
    loader = DataLoader(
        data(args.batches_per_epoch * args.nodes, args.batch_size),
        batch_size=args.batch_size,
        shuffle=True,  # Lightning swaps in a DistributedSampler seeded by seed_everything
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=args.nodes,
        strategy="ddp",
        max_steps=args.max_steps,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, every_n_train_steps=args.every)
        ],
    )
    model = Regression(args.step_time)
    trainer.fit(model, loader)
    x, y = loader.dataset.tensors  # the final weights' loss on all the data: deterministic
    with torch.no_grad():
        loss = nn.functional.mse_loss(model.net(x), y).item()
    if trainer.is_global_zero:
        print(f"world_size={trainer.world_size} step={trainer.global_step} final_loss={loss!r}")


if __name__ == "__main__":
    main()
