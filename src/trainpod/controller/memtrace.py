"""The controller's memory, traced for a soak: tracemalloc snapshots on a timer.

Off unless ``TRAINPOD_TRACEMALLOC_DIR`` is set when the controller starts (tracemalloc costs
the controller about twice its CPU per allocation, so never in production). Then Python's
allocations are traced with ``TRAINPOD_TRACEMALLOC_FRAMES`` frames each (default 8), and a
snapshot is written to ``DIR/snapshot-<n>.tracemalloc`` every ``TRAINPOD_TRACEMALLOC_EVERY_S``
seconds (default 120): compare two with :func:`growth` (``benchmarks/memtrace.py`` does) to
see which lines hold what grew. Only Python's allocations: SQLite's and glibc's own heap
are outside it.
"""

from __future__ import annotations

import logging
import os
import threading
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DIR_ENV = "TRAINPOD_TRACEMALLOC_DIR"
EVERY_ENV = "TRAINPOD_TRACEMALLOC_EVERY_S"
FRAMES_ENV = "TRAINPOD_TRACEMALLOC_FRAMES"


@dataclass(frozen=True)
class Tracing:
    dir: Path
    thread: threading.Thread
    """Writes the snapshots; ends with the ``stop`` it was given, after one last snapshot."""


def start_from_env(stop: threading.Event, env: dict[str, str] | None = None) -> Tracing | None:
    """Start tracing and the snapshot thread when ``DIR_ENV`` says where (None: off)."""
    env = dict(os.environ) if env is None else env
    where = env.get(DIR_ENV)
    if not where:
        return None
    every = float(env.get(EVERY_ENV) or 120.0)
    frames = int(env.get(FRAMES_ENV) or 8)
    if every <= 0 or frames < 1:
        raise SystemExit(f"{EVERY_ENV} must be > 0 and {FRAMES_ENV} >= 1")
    out = Path(where)
    out.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(frames)
    log.warning("tracemalloc on (%d frames): a snapshot every %g s into %s", frames, every, out)

    def loop() -> None:
        n = 0
        while True:
            stopping = stop.wait(every)
            if not tracemalloc.is_tracing():
                return
            n += 1
            path = out / f"snapshot-{n:04d}.tracemalloc"
            try:
                snapshot_to(path)
            except OSError as exc:
                log.warning("tracemalloc snapshot %s failed: %s", path, exc)
            if stopping:
                return

    thread = threading.Thread(target=loop, name="tracemalloc", daemon=True)
    thread.start()
    return Tracing(out, thread)


def snapshot_to(path: Path) -> None:
    """This process's traced allocations now, written atomically to ``path``."""
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    tmp = path.with_name(f".{path.name}.tmp")
    snap.dump(str(tmp))
    os.replace(tmp, path)


@dataclass(frozen=True)
class Growth:
    where: tuple[str, ...]
    """The allocating frames, innermost first (``file:line``)."""
    size_diff: int
    count_diff: int
    size: int


def growth(older: Path, newer: Path, *, frames: int = 4, top: int = 25) -> list[Growth]:
    """What grew from ``older`` to ``newer`` (two snapshots of one process), by allocating
    traceback cut to ``frames``, largest growth first."""
    a = tracemalloc.Snapshot.load(str(older))
    b = tracemalloc.Snapshot.load(str(newer))
    diffs = b.compare_to(a, "traceback") if frames > 1 else b.compare_to(a, "lineno")
    merged: dict[tuple[str, ...], list[int]] = {}
    for d in diffs:
        key = tuple(f"{f.filename}:{f.lineno}" for f in list(d.traceback)[:frames])
        m = merged.setdefault(key, [0, 0, 0])
        m[0] += d.size_diff
        m[1] += d.count_diff
        m[2] += d.size
    ranked = sorted(merged.items(), key=lambda kv: kv[1][0], reverse=True)
    return [Growth(k, v[0], v[1], v[2]) for k, v in ranked[:top]]
