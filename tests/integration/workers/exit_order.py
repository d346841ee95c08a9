"""Rank 0 ends first; rank 1 finishes once rank 0's process has gone.

Written as for ``torchrun --nnodes 2 --nproc-per-node 1`` (env:// only; torchrun's launcher
hosts the store at MASTER_ADDR:MASTER_PORT and outlives the workers). Rank 0 leaves its
result in the store, writes its pid to ``<dir>/rank0.pid`` and exits; rank 1 waits for that
process to be gone, then tears down without a collective: ``destroy_process_group`` and a
read of rank 0's result from the store. Where rank 0 hosted the store, that read finds it
gone (the connection is refused) and rank 1 fails.
"""

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def store() -> dist.TCPStore:
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=10),
    )


def main() -> None:
    where = Path(sys.argv[1])
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t)
    print(f"rank {rank}: all_reduce {t.tolist()}", flush=True)
    if rank == 0:
        store().set("result/0", str(t.sum().item()))
        dist.destroy_process_group()
        (where / "rank0.pid").write_text(str(os.getpid()))
        print("rank 0: leaving first", flush=True)
        return
    pidfile = where / "rank0.pid"
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text() and gone(int(pidfile.read_text()))):
        if time.monotonic() > deadline:
            raise SystemExit("rank 0 did not end within 60 s")
        time.sleep(0.05)
    print(f"rank {rank}: rank 0 has gone; tearing down", flush=True)
    dist.destroy_process_group()
    result = store().get("result/0").decode()
    print(f"rank {rank}: rank 0 left result {result}; done", flush=True)


if __name__ == "__main__":
    main()
    # torch 2.13's Gloo teardown at interpreter exit occasionally aborts ("terminate called
    # without an active exception", SIGABRT) after the work is done, whoever hosts the store
    # (see torchrun_style.py); leave without it: this test is about the store.
    sys.stdout.flush()
    os._exit(0)
