"""One rank, run as a POSIX account: reports a beacon every step and saves a
trainpod.Checkpointer (memory tier, handed to the agent, which persists it to the durable
dir) every few steps, until it is cancelled.

argv: DURABLE_DIR. Prints ``sockets beacon=<path> ckpt=<path>`` first, then ``dirs
memory=<the job's memory-tier dir> scratch=<the job's scratch dir> notice=<notice file>``,
``saved=<step>`` for every save; on a preemption notice ``noticed file=<whether the notice
file can be seen>``, a last save, and exit 0.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import trainpod


def main() -> None:
    print(
        f"sockets beacon={os.environ['TRAINPOD_BEACON_SOCKET']} "
        f"ckpt={os.environ['TRAINPOD_CKPT_SOCKET']}",
        flush=True,
    )
    ck = trainpod.Checkpointer(dir=sys.argv[1], every=3)
    notice = os.environ["TRAINPOD_NOTICE_FILE"]
    assert ck.layout.memory is not None
    print(
        f"dirs memory={ck.layout.memory.parent} "
        f"scratch={os.environ['TRAINPOD_JOB_SCRATCH_DIR']} notice={notice}",
        flush=True,
    )
    state = {"w": torch.zeros(16)}
    step = 0
    while True:
        state["w"].fill_(step)
        trainpod.report(step)
        if trainpod.preempted():
            print(f"noticed file={Path(notice).exists()}", flush=True)
            ck.save(step, state)
            ck.wait()
            return
        if ck.due(step):
            ck.save(step, state)
            print(f"saved={step}", flush=True)
        step += 1
        time.sleep(0.2)


if __name__ == "__main__":
    main()
