"""Helpers the benchmarks share: percentiles, and a throwaway local cluster, deleted even
under Ctrl-C."""

from __future__ import annotations

import math
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from trainpod.backends.base import Backend
from trainpod.backends.local import LocalBackend
from trainpod.client.http import TrainpodClient
from trainpod.paths import ClusterPaths, read_secret
from trainpod.spec.loading import load_cluster_spec
from trainpod.testing.wait import wait_until


@dataclass(frozen=True)
class LocalCluster:
    paths: ClusterPaths
    backend: LocalBackend
    client: TrainpodClient
    tmp: Path
    """A temporary directory of its own (TRAINPOD_HOME is under it), removed afterwards."""


@contextmanager
def local_cluster(name: str, spec_text: str, prefix: str) -> Iterator[LocalCluster]:
    """A throwaway local cluster of ``spec_text`` under a temporary TRAINPOD_HOME, its nodes
    idle; deleted afterwards, also on Ctrl-C or SIGTERM."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        os.environ["TRAINPOD_HOME"] = str(Path(tmp) / "home")
        spec_path = Path(tmp) / f"{name}.yaml"
        spec_path.write_text(spec_text)
        paths = ClusterPaths.of(name)
        backend = LocalBackend(paths)
        signal.signal(signal.SIGTERM, raise_interrupt)
        try:
            record = backend.create(load_cluster_spec(spec_path), spec_path)
            with TrainpodClient(record.url, read_secret(paths.admin_token)) as client:
                wait_until(
                    lambda: all(n.state == "idle" for n in client.nodes()),
                    timeout_s=300,
                    what="nodes idle",
                )
                yield LocalCluster(paths, backend, client, Path(tmp))
        finally:
            with signals_ignored():
                delete_cluster(backend, paths)


def copy_logs(paths: ClusterPaths, dest: Path) -> None:
    """The controller's and agents' logs (before the delete stops the agents), and every
    rank's log (``jobs/<job>/attempt-<n>/rank-<r>.log``: what a rank said before it failed
    or gave a recovery up)."""
    dest.mkdir(parents=True, exist_ok=True)
    logs = [*paths.logs.glob("*.log"), *paths.state_dir.glob("nodes/*/agent.log")]
    for log in logs:
        name = log.name if log.parent == paths.logs else f"agent-{log.parent.name}.log"
        shutil.copyfile(log, dest / name)
    for rank_log in paths.jobs_dir.glob("*/attempt-*/rank-*.log"):
        job, attempt = rank_log.parent.parent.name, rank_log.parent.name
        shutil.copyfile(rank_log, dest / f"job-{job}-{attempt}-{rank_log.name}")


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


def json_safe(value: Any) -> Any:
    """NaN and infinity (a figure with no samples, or too many unanswered) as null: JSON has
    neither."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
