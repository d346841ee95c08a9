"""Dispatch benchmark: how fast a local trainpod cluster turns a submit into a running rank.

It creates a throwaway local cluster (``bench-dispatch``: one compute group ``workers`` of
2 nodes with 1 device each, default heartbeats, no lifecycle scripts) in a temporary
``$TRAINPOD_HOME``, measures, and always deletes it again (``purge=True``), on errors and
Ctrl-C too.

What it measures:

* Latency: ``--latency-jobs`` trivial one-node, one-process jobs, one at a time (each after
  the previous has completed). The rank runs ``python -c "import time; print(time.time())"``.
  For each job:

  - (a) submit -> first rank instruction: the client's ``time.time()`` just before
    ``client.submit`` to the timestamp the rank printed (read back from rank 0's log);
  - (b) submit -> spawn: ``rank_started.data.started_at - job_submitted.ts`` (events);
  - (c) submit -> completed: the ``job_state`` completed event's ts minus the client's submit
    time, and also as the client saw it (polling ``client.job`` every 10 ms).

  p50/p95/max of each, plus the breakdown of (a) into HTTP submit, controller -> agent
  spawn, and process start-up.
* Floor: the same process started directly with ``subprocess.Popen`` (Popen to its printed
  timestamp), once after each latency job so both run under the same load; trainpod's p50 (a)
  is reported as a ratio to the floor's median and as an overhead in ms.
* Burst: ``--burst-jobs`` jobs running ``/bin/true`` (so it is about dispatch, not Python
  start-up), submitted back to back from one client; then it polls ``client.jobs()`` until all
  have ended (or a deadline passes). Reports the submit rate and the dispatch+complete rate
  (jobs from the first submit to the last completion), and counts jobs that did not complete.

Target: p50 submit -> first rank instruction < 0.5 s (PASS/FAIL is printed).

Run it from the repository root::

    .venv/bin/python benchmarks/dispatch.py [--latency-jobs 30] [--burst-jobs 200] \
        [--json benchmarks/results/dispatch.json]

It prints a plain-text table and writes every figure and raw sample as JSON to ``--json``.
The exit status is 1 when any job did not complete, 0 otherwise (a missed target is reported,
not an error).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchkit import copy_logs, delete_cluster, percentile, raise_interrupt, signals_ignored
from trainpod.api.models import EventInfo, JobInfo
from trainpod.backends.base import backend_for
from trainpod.cli.jobs import default_env
from trainpod.client.http import TrainpodClient
from trainpod.paths import ClusterPaths, read_secret
from trainpod.spec.job import JobSpec
from trainpod.spec.loading import load_cluster_spec

CLUSTER = "bench-dispatch"
SPEC_YAML = f"""\
name: {CLUSTER}
backend: local
instance_groups:
  - name: workers
    role: compute
    count: 2
    devices_per_node: 1
"""
PRINT_TIME = [sys.executable, "-c", "import time; print(time.time())"]
BURST_COMMAND = ["/bin/true"]
ENDED = frozenset({"completed", "failed", "cancelled", "preempted"})
TARGET_P50_S = 0.5
JOB_POLL_S = 0.010
BURST_POLL_S = 0.2
NODES_READY_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 30.0
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "dispatch.json"


# -- statistics -------------------------------------------------------------------------------
def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "max": max(values) if values else float("nan"),
    }


# -- results ----------------------------------------------------------------------------------
@dataclass
class LatencySample:
    job_id: int
    state: str
    submit_to_first_instruction_s: float | None = None  # (a) client clock -> rank's clock
    submit_to_spawn_s: float | None = None  # (b) job_submitted.ts -> rank_started.started_at
    submit_to_completed_s: float | None = None  # (c) client submit -> completed event ts
    submit_to_completed_observed_s: float | None = None  # (c) as the polling client saw it
    http_submit_s: float | None = None  # client submit -> job_submitted.ts
    spawn_to_first_instruction_s: float | None = None  # Popen in the agent -> rank's print
    error: str = ""


@dataclass
class BurstResult:
    jobs: int
    command: list[str]
    submit_s: float = 0.0
    first_submit_to_last_completion_s: float = 0.0
    submit_rate_jobs_s: float = 0.0
    submit_call_s: dict[str, float] = field(default_factory=dict)  # one client.submit call
    dispatch_complete_rate_jobs_s: float = 0.0
    completed: int = 0
    failed: int = 0
    unfinished: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)


# -- the cluster ------------------------------------------------------------------------------
@contextmanager
def throwaway_cluster(
    home: Path, keep_logs: Path | None = None
) -> Iterator[tuple[TrainpodClient, dict[str, float]]]:
    """Create the benchmark cluster under ``home``, wait for its nodes, delete it afterwards.

    Yields a client and the timings of bring-up (and, after the block, tear-down). With
    ``keep_logs``, the controller and agent logs are copied there before the delete.
    """
    os.environ["TRAINPOD_HOME"] = str(home)
    spec_path = home / "cluster.yaml"
    spec_path.write_text(SPEC_YAML)
    spec = load_cluster_spec(spec_path)
    paths = ClusterPaths.of(spec.name, home)
    backend = backend_for(spec.backend, paths)
    timings: dict[str, float] = {}
    try:
        t0 = time.monotonic()
        record = backend.create(spec, spec_path)
        with TrainpodClient(record.url, read_secret(paths.admin_token)) as client:
            wait_for_idle_nodes(client)
            timings["cluster_up_s"] = time.monotonic() - t0
            yield client, timings
    finally:
        t0 = time.monotonic()
        with signals_ignored():
            try:
                if keep_logs is not None:
                    copy_logs(paths, keep_logs)
            finally:
                delete_cluster(backend, paths)
        timings["cluster_delete_s"] = time.monotonic() - t0


def wait_for_idle_nodes(client: TrainpodClient) -> None:
    deadline = time.monotonic() + NODES_READY_TIMEOUT_S
    while True:
        nodes = client.nodes()
        if nodes and all(n.state == "idle" for n in nodes):
            return
        bad = [f"{n.name}: {n.state} {n.reason}" for n in nodes if n.state == "failed"]
        if bad or time.monotonic() > deadline:
            states = ", ".join(f"{n.name}={n.state}" for n in nodes)
            raise RuntimeError(f"nodes did not become idle ({states}) {'; '.join(bad)}")
        time.sleep(0.05)


# -- latency ----------------------------------------------------------------------------------
def wait_for_end(client: TrainpodClient, job_id: int) -> tuple[JobInfo, float]:
    """Poll the job every 10 ms until it ends; return it and the time.time() it was seen."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        info = client.job(job_id)
        if info.state in ENDED:
            return info, time.time()
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {info.state} after {JOB_TIMEOUT_S:g}s")
        time.sleep(JOB_POLL_S)


def _event(events: list[EventInfo], kind: str, **data: Any) -> EventInfo | None:
    for e in events:
        if e.kind == kind and all(e.data.get(k) == v for k, v in data.items()):
            return e
    return None


def printed_time(client: TrainpodClient, job_id: int) -> float:
    """The timestamp the rank printed, from rank 0's log (retried briefly for a late flush)."""
    text = ""
    for _ in range(50):
        text = client.logs(job_id, rank=0).data.strip()
        if text:
            return float(text.splitlines()[0])
        time.sleep(0.01)
    raise RuntimeError(f"job {job_id}: rank 0's log is empty")


def latency_job(client: TrainpodClient, spec: JobSpec) -> LatencySample:
    t_submit = time.time()
    job_id = client.submit(spec).id
    try:
        info, t_seen = wait_for_end(client, job_id)
    except TimeoutError as exc:
        return LatencySample(job_id=job_id, state="timeout", error=str(exc))
    sample = LatencySample(job_id=job_id, state=info.state)
    sample.submit_to_completed_observed_s = t_seen - t_submit
    if info.state != "completed":
        sample.error = info.reason
        return sample
    events = client.events(job_id=job_id)
    submitted = _event(events, "job_submitted")
    started = _event(events, "rank_started", rank=0)
    completed = _event(events, "job_state", new="completed")
    if submitted is None or started is None or completed is None:
        sample.error = f"missing events: {sorted({e.kind for e in events})}"
        return sample
    spawned_at = float(started.data["started_at"])
    first = printed_time(client, job_id)
    sample.submit_to_first_instruction_s = first - t_submit
    sample.submit_to_spawn_s = spawned_at - submitted.ts
    sample.submit_to_completed_s = completed.ts - t_submit
    sample.http_submit_s = submitted.ts - t_submit
    sample.spawn_to_first_instruction_s = first - spawned_at
    return sample


def floor_once(env: dict[str, str], cwd: Path) -> float:
    """Popen -> first printed timestamp of the same command, started directly."""
    t0 = time.time()
    proc = subprocess.Popen(
        PRINT_TIME,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"the floor process exited {proc.returncode}")
    return float(out.split()[0]) - t0


def run_latency(
    client: TrainpodClient, n: int, workdir: Path
) -> tuple[list[LatencySample], list[float]]:
    """``n`` trainpod jobs one at a time, each followed by one direct start (the floor)."""
    spec = JobSpec(
        command=PRINT_TIME,
        name="bench-latency",
        nodes=1,
        procs_per_node=1,
        env=default_env(),
        workdir=str(workdir),
    )
    floor_env = {**os.environ, **default_env(), "PYTHONUNBUFFERED": "1"}
    samples: list[LatencySample] = []
    floors: list[float] = []
    for _ in range(n):
        samples.append(latency_job(client, spec))
        floors.append(floor_once(floor_env, workdir))
    return samples, floors


# -- burst ------------------------------------------------------------------------------------
def run_burst(client: TrainpodClient, n: int, workdir: Path, timeout_s: float) -> BurstResult:
    spec = JobSpec(
        command=BURST_COMMAND,
        name="bench-burst",
        nodes=1,
        procs_per_node=1,
        env=default_env(),
        workdir=str(workdir),
    )
    result = BurstResult(jobs=n, command=BURST_COMMAND)
    ids: set[int] = set()
    calls: list[float] = []
    t_first = time.time()
    for _ in range(n):
        t0 = time.perf_counter()
        ids.add(client.submit(spec).id)
        calls.append(time.perf_counter() - t0)
    result.submit_s = time.time() - t_first
    result.submit_call_s = summary(calls)
    deadline = time.monotonic() + timeout_s
    ended: dict[int, JobInfo] = {}
    while True:
        for info in client.jobs(limit=n):
            if info.id in ids and info.state in ENDED:
                ended[info.id] = info
        if len(ended) == n or time.monotonic() > deadline:
            break
        time.sleep(BURST_POLL_S)
    done = [j for j in ended.values() if j.state == "completed"]
    result.completed = len(done)
    result.failed = len(ended) - len(done)
    result.unfinished = n - len(ended)
    result.failures = [
        {"job_id": j.id, "state": j.state, "reason": j.reason}
        for j in sorted(ended.values(), key=lambda j: j.id)
        if j.state != "completed"
    ][:20]
    last = max((j.ended_at or 0.0 for j in ended.values()), default=t_first)
    result.first_submit_to_last_completion_s = last - t_first
    result.submit_rate_jobs_s = n / result.submit_s if result.submit_s > 0 else 0.0
    if result.unfinished == 0 and last > t_first:
        result.dispatch_complete_rate_jobs_s = n / (last - t_first)
    return result


# -- report -----------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
    }


def _ms(value: float) -> str:
    return f"{value * 1000:9.1f}"


def render(results: dict[str, Any]) -> str:
    lat = results["latency"]["summary"]
    lines = [
        "trainpod dispatch benchmark",
        "  machine: {cpu_count} CPUs, Python {python} ({implementation}), {platform}".format(
            **results["machine"]
        ),
        f"  cluster: {CLUSTER} (local, 2 nodes x 1 device); "
        f"up in {results['cluster']['cluster_up_s']:.2f} s",
        "",
        f"latency: {results['latency']['jobs']} jobs, one at a time, "
        f"command: python -c 'print(time.time())'",
        f"  {'(rows starting with - split (a); their p50s need not add up)':<44}",
        f"  {'':44} {'p50 ms':>9} {'p95 ms':>9} {'max ms':>9}",
    ]
    rows = [
        ("(a) submit -> first rank instruction", "submit_to_first_instruction_s"),
        ("  - HTTP submit (client -> controller)", "http_submit_s"),
        ("  - controller -> agent spawn", "submit_to_spawn_s"),
        ("  - spawn -> first instruction", "spawn_to_first_instruction_s"),
        ("(b) submit -> spawn (events)", "submit_to_spawn_s"),
        ("(c) submit -> completed (event ts)", "submit_to_completed_s"),
        ("(c) submit -> completed (client polling)", "submit_to_completed_observed_s"),
        ("floor: Popen -> first instruction", "floor_s"),
    ]
    for label, key in rows:
        s = lat[key]
        lines.append(f"  {label:<44} {_ms(s['p50'])} {_ms(s['p95'])} {_ms(s['max'])}")
    cmp_ = results["latency"]["vs_floor"]
    lines += [
        f"  p50 (a) vs floor median: x{cmp_['ratio']:.1f}, overhead {cmp_['overhead_ms']:.1f} ms",
        f"  failed: {results['latency']['failed']}",
        "",
    ]
    b = results["burst"]
    lines += [
        f"burst: {b['jobs']} jobs of {' '.join(b['command'])} (no Python start-up), one client",
        f"  submit rate                 {b['submit_rate_jobs_s']:8.1f} jobs/s "
        f"({b['submit_s']:.2f} s; one submit p50 {b['submit_call_s']['p50'] * 1000:.1f} ms, "
        f"max {b['submit_call_s']['max'] * 1000:.1f} ms)",
        f"  dispatch+complete rate      {b['dispatch_complete_rate_jobs_s']:8.1f} jobs/s "
        f"(first submit -> last completion {b['first_submit_to_last_completion_s']:.2f} s)",
        f"  completed {b['completed']}, failed {b['failed']}, unfinished {b['unfinished']}",
        "",
    ]
    t = results["target"]
    verdict = "PASS" if t["pass"] else "FAIL"
    lines += [
        f"target: p50 submit->start < {t['p50_limit_s']} s: "
        f"{verdict} (p50 = {t['p50_s'] * 1000:.1f} ms)",
        f"run time: {results['run_time_s']:.1f} s "
        f"(cluster delete {results['cluster'].get('cluster_delete_s', 0.0):.2f} s)",
    ]
    return "\n".join(lines)


def latency_results(samples: list[LatencySample], floors: list[float]) -> dict[str, Any]:
    ok = [s for s in samples if s.submit_to_first_instruction_s is not None]

    def column(name: str) -> list[float]:
        return [v for s in ok if (v := getattr(s, name)) is not None]

    keys = [
        "submit_to_first_instruction_s",
        "submit_to_spawn_s",
        "submit_to_completed_s",
        "submit_to_completed_observed_s",
        "http_submit_s",
        "spawn_to_first_instruction_s",
    ]
    stats = {k: summary(column(k)) for k in keys}
    stats["floor_s"] = summary(floors)
    p50 = stats["submit_to_first_instruction_s"]["p50"]
    floor = statistics.median(floors) if floors else float("nan")
    return {
        "jobs": len(samples),
        "failed": len(samples) - len(ok),
        "summary": stats,
        "vs_floor": {
            "floor_median_s": floor,
            "ratio": p50 / floor if floor else float("nan"),
            "overhead_ms": (p50 - floor) * 1000,
        },
        "samples": [asdict(s) for s in samples],
        "floor_samples_s": floors,
    }


# -- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--latency-jobs", type=int, default=30, help="jobs run one at a time")
    p.add_argument("--burst-jobs", type=int, default=200, help="jobs submitted back to back")
    p.add_argument(
        "--burst-timeout-s", type=float, default=120.0, help="how long to wait for the burst"
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    p.add_argument(
        "--keep-logs", type=Path, default=None, help="copy the cluster's logs to this directory"
    )
    args = p.parse_args(argv)
    if args.latency_jobs < 1 or args.burst_jobs < 1:
        p.error("--latency-jobs and --burst-jobs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    signal.signal(signal.SIGTERM, raise_interrupt)
    home = Path(tempfile.mkdtemp(prefix="trainpod-bench-"))
    timings: dict[str, float] = {}
    try:
        workdir = home / "work"
        workdir.mkdir()
        with throwaway_cluster(home, args.keep_logs) as (client, timings):
            samples, floors = run_latency(client, args.latency_jobs, workdir)
            burst = run_burst(client, args.burst_jobs, workdir, args.burst_timeout_s)
    finally:
        with signals_ignored():
            shutil.rmtree(home, ignore_errors=True)
    latency = latency_results(samples, floors)
    p50 = latency["summary"]["submit_to_first_instruction_s"]["p50"]
    results: dict[str, Any] = {
        "benchmark": "dispatch",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "cluster": {"name": CLUSTER, "nodes": 2, "devices_per_node": 1, **timings},
        "latency": latency,
        "burst": asdict(burst),
        "target": {"p50_limit_s": TARGET_P50_S, "p50_s": p50, "pass": p50 < TARGET_P50_S},
        "run_time_s": time.monotonic() - t_start,
    }
    print(render(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results: {args.json}")
    failed = latency["failed"] + burst.failed + burst.unfinished
    if failed:
        print(f"{failed} job(s) did not complete", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; the benchmark cluster was deleted", file=sys.stderr)
        sys.exit(130)
