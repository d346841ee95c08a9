"""A one-rank "training" loop for the dashboard's browser test: progress beacons with a
loss, a trainpod.Checkpointer every few steps (so every tier has something to show), a log
line per step, and a resume from the newest checkpoint after a restart.

argv: --steps N [--every K] [--step-s S]

Prints ``attempt=A start=S`` after loading and ``attempt=A step=N loss=L`` for every step;
``done`` at the end.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

import trainpod


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--step-s", type=float, default=0.2)
    args = p.parse_args()
    attempt = os.environ["TRAINPOD_ATTEMPT"]
    ck = trainpod.Checkpointer(every=args.every)
    state = {"w": torch.zeros(1024), "step": -1}
    start = ck.load_latest(state)
    print(f"attempt={attempt} start={start}", flush=True)
    step = 0 if start is None else start + 1
    while step < args.steps:
        time.sleep(args.step_s)
        loss = 4.0 * math.exp(-step / 25) + 0.2 + 0.05 * math.sin(step)
        state["w"].fill_(step)
        state["step"] = step
        print(f"attempt={attempt} step={step} loss={loss:.4f}", flush=True)
        trainpod.report(step, loss=loss, tokens=4096)
        if ck.due(step):
            ck.save(step, state)
        step += 1
    assert ck.close(120)
    print("done", flush=True)


if __name__ == "__main__":
    main()
