"""A small regression model trained with Hugging Face ``accelerate``, checkpointed with
``accelerator.save_state`` every ``--checkpointing_steps`` into ``<output_dir>/step_<N>``.

Written as for ``accelerate launch`` or ``torchrun --nnodes 2 --nproc-per-node 1`` and
nothing else: it knows nothing of trainpod. ``--resume_from_checkpoint PATH`` loads a state
with ``accelerator.load_state`` and skips the batches already done, the pattern of
accelerate's own examples (``complete_nlp_example.py``). Under trainpod the command passes
``--resume_from_checkpoint={resume:ckpt}`` and trainpod fills in the newest complete
``step_N`` (or leaves the flag out on the first attempt)::

    trainpod submit --nodes 2 --auto-resume -- python examples/accelerate/train.py \\
        --output_dir ckpt --max_steps 40 --checkpointing_steps 10 \\
        --resume_from_checkpoint={resume:ckpt}

Deterministic: a seeded sampler (``use_seedable_sampler``) so an epoch's order does not
depend on the RNG state a resume restores; the final loss of a resumed run is bitwise that
of an undisturbed one.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from accelerate.utils import set_seed

from accelerate import Accelerator, DataLoaderConfiguration


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", default="ckpt", help="where step_<N> states go")
    p.add_argument("--max_steps", type=int, default=40)
    p.add_argument("--checkpointing_steps", type=int, default=10)
    p.add_argument("--resume_from_checkpoint", default=None, help="a step_<N> state to load")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--step_delay_s", type=float, default=0.0, help="simulated compute per step (tiny model)"
    )
    return p.parse_args()


def main() -> None:
    args = parse()
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
    set_seed(args.seed)
    g = torch.Generator().manual_seed(1234)  # synthetic data: y = x @ w + noise
    x = torch.randn(2048, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(2048, 1, generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=15, gamma=0.5)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        step = int(os.path.basename(os.path.normpath(args.resume_from_checkpoint))[5:])
    accelerator.print(
        f"world size {accelerator.num_processes}, resume from {args.resume_from_checkpoint}"
    )
    per_epoch = len(loader)
    loss = torch.tensor(0.0)
    while step < args.max_steps:
        epoch, done_in_epoch = divmod(step, per_epoch)
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done_in_epoch) if done_in_epoch else loader
        for xb, yb in batches:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            time.sleep(args.step_delay_s)
            mean = accelerator.reduce(loss.detach(), reduction="mean").item()
            accelerator.print(f"step {step} loss {mean!r}")
            if step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{step}"))
            if step >= args.max_steps:
                break
    final = accelerator.reduce(loss.detach(), reduction="mean").item()
    accelerator.print("final " + json.dumps({"step": step, "loss": final}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
