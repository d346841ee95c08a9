"""Shared pieces of the recovery benchmark: settings, statistics, the cluster, jobs, progress."""

from __future__ import annotations

import itertools
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from benchkit import copy_logs, delete_cluster, percentile, signals_ignored
from trainpod.api.models import ChaosFault, EventInfo
from trainpod.backends.base import backend_for
from trainpod.cli.jobs import default_env
from trainpod.client.http import TrainpodClient
from trainpod.errors import Conflict, TrainpodError
from trainpod.paths import ClusterPaths, read_secret
from trainpod.spec.job import JobSpec
from trainpod.spec.loading import load_cluster_spec

ROOT = Path(__file__).resolve().parents[2]
STEPS = ROOT / "benchmarks" / "workers" / "steps.py"
GPT = ROOT / "examples" / "gpt" / "train.py"
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "recovery.json"

CLUSTER = "bench-recovery"
HANG_TIMEOUT_S = 3.0
SPEC_YAML = f"""\
name: {CLUSTER}
backend: local
instance_groups:
  - name: workers
    count: 2
    devices_per_node: 1
  - name: spares
    count: 1
    devices_per_node: 1
    spare: true
  - name: duo
    count: 1
    devices_per_node: 2
partitions:
  - name: main
    groups: [workers, spares]
    default: true
  - name: duo
    groups: [duo]
storage:
  node_scratch_quota_gib: 0.25
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 3
  check_interval_s: 0.5
  hang_timeout_s: {HANG_TIMEOUT_S}
"""
MAIN_GROUPS = frozenset({"workers", "spares"})
ENDED = frozenset({"completed", "failed", "cancelled", "preempted"})

STEP_S = 0.05
WARM_S = 1.0  # steps between a restart's first beacon (or a start) and the next injection
POLL_S = 0.1
NODES_READY_TIMEOUT_S = 60.0
START_TIMEOUT_S = 90.0  # a job's first beacon
RECOVERY_TIMEOUT_S = 90.0  # injection -> the restarted attempt's first beacon
POOL_TIMEOUT_S = 180.0  # repaired nodes back to idle
TORCHRUN_MAX_RESTARTS = 3
SLOW_WATCH_S = 12.0
CHAOS_FAULTS: tuple[ChaosFault, ...] = ("kill-worker", "xid79", "kill-agent", "hang")
CKPT_TARGET_S = 20.0  # GPT: about one checkpoint per this much training
CHAOS_STEP_MARGIN = 3.0  # GPT --steps = this x chaos time / calibrated step time
CHAOS_END_GRACE_S = 120.0  # at the end, wait this long at most for the job to run again

TARGET_CRASH_DETECT_S = 1.0
TARGET_HANG_SLACK_S = 1.0
TARGET_RATIO = 0.5
TARGET_GPU_FIRST_STEP_S = 10.0
TARGET_ETTR_POINTS = 3.0

T = TypeVar("T")


# -- statistics -------------------------------------------------------------------------------
def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "max": max(values) if values else float("nan"),
    }


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- the cluster ------------------------------------------------------------------------------
@contextmanager
def throwaway_cluster(home: Path, keep_logs: Path | None) -> Iterator[TrainpodClient]:
    """Create the benchmark cluster under ``home``, wait for its nodes, delete it afterwards
    (after copying the controller's and agents' logs to ``keep_logs`` when given)."""
    os.environ["TRAINPOD_HOME"] = str(home)
    spec_path = home / "cluster.yaml"
    spec_path.write_text(SPEC_YAML)
    spec = load_cluster_spec(spec_path)
    paths = ClusterPaths.of(spec.name, home)
    backend = backend_for(spec.backend, paths)
    try:
        record = backend.create(spec, spec_path)
        with TrainpodClient(record.url, read_secret(paths.admin_token)) as client:
            wait_until(
                lambda: all_idle(client, groups=None),
                NODES_READY_TIMEOUT_S,
                "every node idle after creating the cluster",
            )
            yield client
    finally:
        with signals_ignored():
            try:
                if keep_logs is not None:
                    copy_logs(paths, keep_logs)
            finally:
                delete_cluster(backend, paths)


def wait_until(probe: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Call ``probe`` every POLL_S until it returns something truthy; TimeoutError after."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(POLL_S)


def all_idle(
    client: TrainpodClient, groups: frozenset[str] | None, holding: frozenset[str] = frozenset()
) -> bool:
    """Every node (of ``groups``) is idle, except those in ``holding`` (a job's nodes)."""
    nodes = [n for n in client.nodes() if groups is None or n.group in groups]
    return bool(nodes) and all(n.state == "idle" for n in nodes if n.name not in holding)


# -- jobs and their events --------------------------------------------------------------------
class JobEnded(RuntimeError):
    pass


class JobWatch:
    """The events of one job, fetched incrementally."""

    def __init__(self, client: TrainpodClient, job_id: int) -> None:
        self.client = client
        self.job_id = job_id
        self.events: list[EventInfo] = []

    def poll(self) -> None:
        after = self.events[-1].id if self.events else 0
        self.events += self.client.events(job_id=self.job_id, after=after)

    def find(self, kind: str, attempt: int | None = None, **data: Any) -> EventInfo | None:
        for e in self.events:
            if e.kind != kind or (attempt is not None and e.attempt != attempt):
                continue
            if all(e.data.get(k) == v for k, v in data.items()):
                return e
        return None

    def all(self, kind: str, attempt: int | None = None) -> list[EventInfo]:
        return [
            e for e in self.events if e.kind == kind and (attempt is None or e.attempt == attempt)
        ]

    def ended(self) -> EventInfo | None:
        return next(
            (e for e in self.events if e.kind == "job_state" and e.data.get("new") in ENDED),
            None,
        )

    def wait_beacon_after(self, attempt: int, timeout_s: float) -> EventInfo:
        """The first ``first_beacon`` of an attempt numbered above ``attempt``."""

        def probe() -> EventInfo | None:
            self.poll()
            for e in self.events:
                if e.kind == "first_beacon" and (e.attempt or 0) > attempt:
                    return e
            if (end := self.ended()) is not None:
                raise JobEnded(f"job {self.job_id} ended ({end.data.get('new')}): {self.reason()}")
            return None

        return wait_until(
            probe, timeout_s, f"a first beacon of job {self.job_id} after attempt {attempt}"
        )

    def reason(self) -> str:
        with suppress(TrainpodError):
            return (self.client.job(self.job_id).reason.splitlines() or [""])[0]
        return ""


def steps_spec(
    name: str,
    ckpt: Path,
    workdir: Path,
    *,
    nodes: int = 2,
    procs: int = 1,
    partition: str = "main",
    env: dict[str, str] | None = None,
) -> JobSpec:
    return JobSpec(
        command=[sys.executable, str(STEPS), "--ckpt-dir", str(ckpt), "--step-s", str(STEP_S)],
        name=name,
        nodes=nodes,
        procs_per_node=procs,
        partition=partition,
        env={**default_env(), **(env or {})},
        workdir=str(workdir),
        auto_resume=True,
        max_restarts=1000,  # crash and hang restarts count; many injections per job
    )


def node_of_rank(client: TrainpodClient, job_id: int, rank: int) -> tuple[str, int]:
    """(node, attempt number) of ``rank`` in the job's latest attempt."""
    job = client.job(job_id)
    attempt = job.attempts[-1]
    for r in attempt.ranks:
        if r.rank == rank:
            return r.node, attempt.number
    raise RuntimeError(f"job {job_id} attempt {attempt.number} has no rank {rank}")


def end_job(client: TrainpodClient, job_id: int) -> None:
    """Cancel the job (if it still runs) and wait until it has ended."""
    with suppress(Conflict):
        client.cancel(job_id)
    wait_until(lambda: client.job(job_id).state in ENDED, 60.0, f"job {job_id} to end")


# -- progress files (steps.py) ----------------------------------------------------------------
LINE_RE = re.compile(r"^gen=(\d+) rank=(\d+) pid=(\d+) step=(-?\d+) t=([0-9.]+)$")


@dataclass(frozen=True)
class StepLine:
    gen: int
    rank: int
    pid: int
    step: int  # -1: the process started (before import torch)
    t: float


def read_progress(ckpt: Path) -> list[StepLine]:
    out: list[StepLine] = []
    for path in sorted(ckpt.glob("progress-rank*.log")):
        for line in path.read_text().splitlines():
            if m := LINE_RE.match(line):
                g, r, p, s, t = m.groups()
                out.append(StepLine(int(g), int(r), int(p), int(s), float(t)))
    return out


SPLIT = (  # a restart from the fault to the first step, from the progress lines
    ("to_spawn_s", "->spawn"),  # the new generation's last rank started its script
    ("imports_s", "imports"),  # -> torch and trainpod imported on every rank
    ("pg_init_s", "pg+resume"),  # -> process group up, resume step agreed (every rank)
    ("to_step_s", "->step"),  # -> the first step done
)


def split_start(lines: list[StepLine], gen: int, fault_at: float | None) -> dict[str, float | None]:
    """The start of generation ``gen`` after a fault at ``fault_at``, in SPLIT's segments."""

    def last(step: int) -> float | None:
        return max((x.t for x in lines if x.gen == gen and x.step == step), default=None)

    marks = [fault_at, last(-1), last(-2), last(-3), gen_first_step(lines, gen)]
    pairs = zip(SPLIT, itertools.pairwise(marks), strict=True)
    return {key: _diff(b, a) for (key, _), (a, b) in pairs}


def gen_first_step(lines: list[StepLine], gen: int) -> float | None:
    """When generation ``gen`` finished its first step (on any rank)."""
    return min((x.t for x in lines if x.gen == gen and x.step >= 0), default=None)


def _diff(b: float | None, a: float | None) -> float | None:
    return None if a is None or b is None else b - a


def _count(items: Iterator[str] | Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out
