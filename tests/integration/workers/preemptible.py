"""A 2-rank Gloo training loop that saves a trainpod.Checkpointer every K steps and, unless
``--ignore``, saves at once on the preemption notice and exits.

argv: [--every K] [--more N] [--ignore]

Prints ``rank=R attempt=A start=S tier=T`` after loading, ``rank=R attempt=A step=N`` for
every step, ``rank=R attempt=A saved-on-notice=N`` when it saves on the notice, and
``rank=R done`` at the end. Attempt 1 runs until it is preempted (it never ends on its own);
a later attempt runs ``--more`` steps past the step it resumed from, then ends.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import trainpod


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--more", type=int, default=10)
    p.add_argument("--ignore", action="store_true", help="never ask for the notice")
    args = p.parse_args()
    ignored = signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TRAINPOD_ATTEMPT"])
    who = f"rank={rank} attempt={attempt}"
    print(f"{who} notice signal ignored at start: {ignored}", flush=True)
    ck = trainpod.Checkpointer(every=args.every)
    assert ck.layout.memory is not None
    print(f"memory={ck.layout.memory.parent}", flush=True)
    state = {"w": torch.zeros(64), "step": -1}
    start = ck.load_latest(state)
    assert ck.last_load is not None
    print(f"{who} start={start} tier={ck.last_load.tier}", flush=True)
    for why in ck.last_load.reasons:
        print(f"{who} passed over: {why}", flush=True)
    step = 0 if start is None else start + 1
    end = None if attempt == 1 else step + args.more
    while end is None or step < end:
        t = torch.tensor([float(step)])
        dist.all_reduce(t)  # in lockstep, as DDP is
        state["w"].fill_(step)
        state["step"] = step
        print(f"{who} step={step}", flush=True)
        trainpod.report(step)
        if not args.ignore and trainpod.preempted(sync=True):  # every rank stops here
            ck.save(step, state)
            assert ck.wait(120)
            print(f"{who} saved-on-notice={step}", flush=True)
            sys.exit(0)
        if ck.due(step):
            ck.save(step, state)
        time.sleep(0.05)
        step += 1
    assert ck.close(120)
    print(f"rank={rank} done", flush=True)


if __name__ == "__main__":
    main()
