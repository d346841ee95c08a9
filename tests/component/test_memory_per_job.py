"""The controller keeps nothing per ended job (issue 14, the soak; ADR 0041, 0043).

A real controller on SQLite with fake agents runs one-node jobs to their end, a job's page
read and ``/metrics`` scraped along the way, its caches bounded small so that they are full
before anything is measured. tracemalloc then measures what the controller's own code
(``trainpod`` outside ``trainpod.testing``) holds after 200 more jobs than before: memory
that grows with the number of jobs ever run, as ``/metrics``' labels of every job once did
(~215 bytes a job, measured with this test), is a leak however slow. The controller as it is
keeps ~5 bytes a job here (dict resizes).
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pytest

import trainpod
from trainpod.api import models
from trainpod.bounded import ByteBoundedCache
from trainpod.testing import FakeClock, FakeGroup, make_config

from .conftest import Cluster

SMALL = 64 << 10
JOBS = 200
PER_JOB_BYTES = 100
"""The most the controller may keep per job, on average over JOBS jobs: dict and list
resizes of bounded structures show as a few KiB; a kept label alone was ~160 bytes."""
_OURS = str(Path(trainpod.__file__).parent)
_HARNESS = str(Path(trainpod.__file__).parent / "testing")


def _run(c: Cluster, jobs: int) -> None:
    for i in range(jobs):
        job = c.submit(nodes=1, procs=1, team=("vision", "speech")[i % 2])
        attempt = c.start(job)
        c.agents[c.job(job).attempts[0].nodes[0]].exit_all(attempt)
        c.beat()
        c.clock.advance(1.0)
        if i % 20 == 0:
            c.controller.metrics.scrape()
            c.controller.job_info(job)


def _controller_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """Bytes whose innermost trainpod frame is the controller's code, not the harness."""
    total = 0
    for trace in snapshot.traces:
        ours = [f.filename for f in trace.traceback if f.filename.startswith(_OURS)]
        if ours and not ours[0].startswith(_HARNESS):  # tracemalloc: innermost first
            total += trace.size
    return total


@pytest.mark.timeout(300)  # tracemalloc slows every allocation: ~20 s quiet, more loaded
def test_the_controller_keeps_nothing_per_ended_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models, "_SEALED", ByteBoundedCache(SMALL))
    cfg = make_config(
        tmp_path, groups=(FakeGroup("workers", 2, devices=1),), view_cache_bytes=SMALL
    )
    c = Cluster(cfg, tmp_path / "state.db", FakeClock())
    models._SEALED.resize(SMALL)  # the controller sized it for its 2 nodes (2 MiB)
    try:
        c.up()
        _run(c, 150)  # the caches full, the structures of a running controller grown
        tracemalloc.start(12)  # frames enough to reach ours under pydantic's and json's
        try:
            _run(c, 20)
            gc.collect()
            before = _controller_bytes(tracemalloc.take_snapshot())
            _run(c, JOBS)  # a job's goodput is kept a minute (of the fake clock) after it ends
            gc.collect()
            after = _controller_bytes(tracemalloc.take_snapshot())
        finally:
            tracemalloc.stop()
    finally:
        c.close()
    grown = after - before
    assert grown < PER_JOB_BYTES * JOBS, (
        f"the controller holds {grown} bytes more after {JOBS} more jobs "
        f"({grown / JOBS:.0f} per job)"
    )
