"""The process that holds one node of an allocation made by ``trainpod alloc``.

An allocation is a job like any other (queued, scheduled, placed as a gang); its one rank
per node is this process, which does nothing but wait to be told to stop, so the scheduler
sees the nodes as taken while the user works in a shell on them. It sends no progress
beacon, so the hang watchdog never judges it (before a first beacon only a job's
``startup_timeout_s`` applies, and an allocation has none), and it exits 0 on SIGTERM,
SIGINT or SIGHUP: ending an allocation is never a fault.

Run it as ``python -m trainpod.agent.hold``. It imports nothing of trainpod's but this
module, so it starts in milliseconds, and it needs no torch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def hold(stop: threading.Event) -> int:
    """Wait until ``stop`` is set; the exit code (0)."""
    stop.wait()
    return 0


def main() -> None:
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    for sig in _STOP_SIGNALS:
        signal.signal(sig, on_signal)
    node = os.environ.get("TRAINPOD_NODE", "?")
    job = os.environ.get("TRAINPOD_JOB_ID", "?")
    print(f"trainpod: holding {node} for allocation {job} (pid {os.getpid()})", flush=True)
    code = hold(stop)
    print(f"trainpod: allocation {job} released on {node}", flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
