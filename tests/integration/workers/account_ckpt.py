"""One rank, run as a POSIX account: reports a beacon every step and saves a
trainpod.Checkpointer (memory tier, handed to the agent, which persists it to the durable
dir) every few steps, until it is cancelled.

argv: DURABLE_DIR. Prints ``sockets beacon=<path> ckpt=<path>`` first, ``saved=<step>`` for
every save.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import trainpod


def main() -> None:
    print(
        f"sockets beacon={os.environ['TRAINPOD_BEACON_SOCKET']} "
        f"ckpt={os.environ['TRAINPOD_CKPT_SOCKET']}",
        flush=True,
    )
    ck = trainpod.Checkpointer(dir=sys.argv[1], every=3)
    state = {"w": torch.zeros(16)}
    step = 0
    while True:
        state["w"].fill_(step)
        trainpod.report(step)
        if ck.due(step):
            ck.save(step, state)
            print(f"saved={step}", flush=True)
        step += 1
        time.sleep(0.2)


if __name__ == "__main__":
    main()
