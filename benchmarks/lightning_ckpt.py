"""Lightning checkpoint save: Lightning's own ``TorchCheckpointIO`` vs trainpod's tiered
``Checkpointer`` behind Lightning's ``CheckpointIO`` interface.

The checkpoint is what ``Trainer.save_checkpoint`` hands a ``CheckpointIO``: a nested dict of
the model's ``state_dict``, the optimizer's (SGD with momentum: one buffer per parameter), the
loops' progress and the callbacks' states; here built directly (no Trainer, no process group)
from an MLP of ``--params-m`` million parameters. Per method, the training *stall* (how long
``save_checkpoint`` blocks the loop) and the time until the save is *durable*:

* ``lightning``: ``TorchCheckpointIO.save_checkpoint`` (``torch.save`` into memory, then an
  fsspec transaction: temp file + rename); blocking, so stall = durable;
* ``trainpod``: :class:`TieredCheckpointIO` below, ``Checkpointer.save(step, checkpoint)``
  (a copy into staging buffers, then DCP writes to shared memory and the durable directory
  on background threads; no agent: ``agent=False``); durable = ``Checkpointer.wait()``.

Medians of ``--runs`` runs after one warm-up. Run it under the shared lock, with the load::

    flock /tmp/bench.lock .venv/bin/python benchmarks/lightning_ckpt.py [--params-m 25]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.plugins.io import TorchCheckpointIO

from trainpod import Checkpointer


class TieredCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through trainpod's ``Checkpointer``: the path's
    step (the checkpoint's ``global_step``) is the Checkpointer's step; loading is the
    Checkpointer's ``load_latest``. What the benchmark measures, not the integration's choice
    (ADR 0029)."""

    def __init__(self, ckpt: Checkpointer) -> None:
        self.ckpt = ckpt

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        self.ckpt.save(int(checkpoint["global_step"]), checkpoint)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        raise NotImplementedError("the benchmark only saves")

    def remove_checkpoint(self, path: Any) -> None:
        pass


def checkpoint(params_m: float, step: int) -> dict[str, Any]:
    width = 1024
    layers = max(1, round(params_m * 1e6 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # creates the momentum buffers
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2.6",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}}},
        "callbacks": {"ModelCheckpoint": {"best_model_path": "", "last_model_path": "last.ckpt"}},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-m", type=float, default=25.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lightning-ckpt-", dir=args.dir))
    ck = checkpoint(args.params_m, 0)
    mb = sum(t.numel() * t.element_size() for t in ck["state_dict"].values()) * 2 / 1e6
    rows: dict[str, list[tuple[float, float]]] = {"lightning": [], "trainpod": []}
    tiered = Checkpointer(root / "tiered", every=1, agent=False, peer=False)
    io = TieredCheckpointIO(tiered)
    try:
        for run in range(args.runs + 1):  # run 0 warms up
            ck["global_step"] = run
            t0 = time.perf_counter()
            TorchCheckpointIO().save_checkpoint(ck, root / f"last-{run}.ckpt")
            lightning = time.perf_counter() - t0
            t0 = time.perf_counter()
            io.save_checkpoint(ck, root / f"tiered-{run}.ckpt")
            stall = time.perf_counter() - t0
            assert tiered.wait(600), "the tiered save did not commit in 600 s"
            durable = time.perf_counter() - t0
            if run:
                rows["lightning"].append((lightning, lightning))
                rows["trainpod"].append((stall, durable))
    finally:
        tiered.close(60, release_memory=True)
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()[0]
    print(f"checkpoint ~{mb:.0f} MB (model + momentum), {args.runs} runs, 1-min load {load:.2f}")
    print(f"{'method':<10} {'stall s':>8} {'durable s':>10}")
    for name, vals in rows.items():
        stall = statistics.median(v[0] for v in vals)
        durable = statistics.median(v[1] for v in vals)
        print(f"{name:<10} {stall:>8.3f} {durable:>10.3f}")


if __name__ == "__main__":
    main()
