"""Helpers the benchmarks share: percentiles, and a throwaway cluster's clean-up even under
Ctrl-C."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from trainpod.backends.base import Backend
from trainpod.paths import ClusterPaths


def copy_logs(paths: ClusterPaths, dest: Path) -> None:
    """The controller's and agents' logs (before the delete stops the agents)."""
    dest.mkdir(parents=True, exist_ok=True)
    logs = [*paths.logs.glob("*.log"), *paths.state_dir.glob("nodes/*/agent.log")]
    for log in logs:
        name = log.name if log.parent == paths.logs else f"agent-{log.parent.name}.log"
        shutil.copyfile(log, dest / name)


def delete_cluster(backend: Backend, paths: ClusterPaths) -> None:
    if paths.record.exists():
        backend.delete(purge=True)


@contextmanager
def signals_ignored() -> Iterator[None]:
    """Let a clean-up finish even if Ctrl-C is pressed again meanwhile."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linearly interpolated between closest ranks."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
