"""Dispatch benchmark: how fast trainpod turns a submit into a running rank, on the embedded
(local) backend and on Slurm, side by side with plain ``sbatch`` on the same Slurm.

One run measures up to three backends (``--backends local,slurm,sbatch``, default all) under
the same conditions: their latency jobs are interleaved (spread evenly over one phase, so
drifts in the box's load hit all of them alike) and their bursts run one after the other.

* ``local``: a throwaway embedded cluster (``bench-dispatch``: one compute group ``workers``
  of 2 nodes with 1 device each, default heartbeats, no lifecycle scripts).
* ``slurm``: trainpod on Slurm. A private Slurm is started with ``scripts/slurm-ci up --dir
  DIR`` (4 nodes x 8 CPUs on this machine, deliberately oversubscribed; it installs Slurm
  if needed) and a ``backend: slurm`` cluster ``bench-slurm`` (node[1-4], 1 device each,
  ``slurm.conf`` = DIR/slurm.conf) is created. Each
  trainpod job is a Slurm batch job whose script ``srun``s one trainpod agent per node; the
  agent registers, the controller starts the rank on it, and the agent leaves when the job
  has ended. trainpod's Slurm jobs ask for whole nodes (``--exclusive``, in every batch
  script). The agents run with
  ``TRAINPOD_WARM_START=0`` (``--slurm-warm-start`` keeps the default): an agent lives for
  one job, so a warm zygote (torch preloaded) would cost an import per job and serve no rank
  (``python -c`` and ``/bin/true`` always start cold).
* ``sbatch``: plain Slurm on the same private Slurm: ``sbatch --wrap`` of the same command.
  Its burst runs twice: as is (Slurm packs up to 8 jobs per node) and with ``--exclusive``
  (one job per node, like trainpod's).

Both clusters live in one temporary ``$TRAINPOD_HOME``. Everything is always torn down
again (clusters deleted with ``purge=True``, then ``slurm-ci down --purge``), on errors and
Ctrl-C too.

What it measures:

* Latency: trivial one-node, one-process jobs, one at a time (each after the previous has
  completed; for Slurm-backed ones also after Slurm has ended the job):
  ``--latency-jobs`` on ``local``, ``--slurm-latency-jobs`` each on ``slurm`` and ``sbatch``.
  The command is ``python -c "import time; print(time.time())"``.

  - (a) submit -> first instruction: the client's ``time.time()`` just before the submit to
    the timestamp the command printed (rank 0's log; for ``sbatch``, its ``--output`` file);
  - local, as before: (b) submit -> spawn (events), (c) submit -> completed (event ts, and as
    the client saw it polling every 10 ms), the breakdown of (a), and the floor: the same
    process started with ``subprocess.Popen`` once after each local job;
  - Slurm-backed: milestones after the submit: the submit call returned (trainpod: HTTP,
    including the controller's ``sbatch``), slurmctld allocated the node, slurmd launched
    the batch script, slurmd launched the agent's ``srun`` step, the agent registered (its
    first heartbeat: ``agent_registered``/``node_allocated`` events), the rank was spawned,
    the first instruction, trainpod's job completed, Slurm's job done; and, after each
    trainpod-on-Slurm job, the agent's floor: ``python -c 'import trainpod.agent.main'``
    (interpreter and imports, no work), to compare with step launch -> registered. Slurm's
    milestones come from its logs (millisecond timestamps). slurmctld starts batch jobs only
    on its scheduling passes, about once a second, so a sleep of uniform(0, ``--gap-s``)
    precedes each Slurm-backed submit: samples then land at random phases of that cadence
    instead of at the phase the previous job left.
* Burst: jobs running ``/bin/true`` (dispatch, not Python start-up) submitted back to back
  from one client, then polled until all have ended: ``--burst-jobs`` on ``local``,
  ``--slurm-burst-jobs`` each on ``slurm`` and ``sbatch`` (``sbatch --wrap true``, polled
  with ``squeue --json``). Reports the submit rate and the dispatch+complete rate (jobs per
  second from the first submit to the last completion: trainpod's ``ended_at``; for plain
  sbatch, slurmctld's "done"), the peak number of Slurm allocations held at once, the
  number of scheduler passes that started them, and the machine's busy CPU time.

Target (local): p50 submit -> first rank instruction < 0.5 s (PASS/FAIL is printed).

Run it from the repository root (Slurm-backed backends need root, like ``slurm-ci``)::

    .venv/bin/python benchmarks/dispatch.py [--backends local,slurm,sbatch] \
        [--latency-jobs 30] [--burst-jobs 200] [--slurm-latency-jobs 25] \
        [--slurm-burst-jobs 40] [--json benchmarks/results/dispatch.json]

It prints plain-text tables (per backend, then side by side with ratios) and writes every
figure and raw sample as JSON to ``--json``. The exit status is 1 when any job did not
complete, 0 otherwise (a missed target is reported, not an error).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchkit import copy_logs, delete_cluster, json_safe, raise_interrupt, signals_ignored
from dispatchkit import (
    BurstResult,
    CpuMeter,
    LatencySample,
    PrivateSlurm,
    agent_import_once,
    private_slurm,
    sbatch_burst,
    sbatch_latency_job,
    slurm_burst_tail,
    summary,
)
from dispatchreport import (
    BACKENDS,
    comparison,
    latency_results,
    loadavg,
    machine,
    render,
)
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
SLURM_CLUSTER = "bench-slurm"
SLURM_SPEC_YAML = """\
name: {name}
backend: slurm
instance_groups:
  - name: workers
    count: {count}
    devices_per_node: 1
    slurm: {{nodes: "{nodes}"}}
slurm:
  conf: {conf}
partitions:
  - {{name: debug, groups: [workers], default: true}}
"""
PRINT_TIME = [sys.executable, "-c", "import time; print(time.time())"]
BURST_COMMAND = ["/bin/true"]
ENDED = frozenset({"completed", "failed", "cancelled", "preempted"})
TARGET_P50_S = 0.5
JOB_POLL_S = 0.010
BURST_POLL_S = 0.2
NODES_READY_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 30.0
SLURM_JOB_TIMEOUT_S = 60.0
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "dispatch.json"
DEFAULT_SLURM_DIR = Path("/tmp/tp-bench-slurm")


# -- the clusters -----------------------------------------------------------------------------
@contextmanager
def throwaway_cluster(
    home: Path,
    spec_yaml: str,
    *,
    keep_logs: Path | None = None,
    create_env: dict[str, str] | None = None,
    wait_nodes: bool = True,
) -> Iterator[tuple[TrainpodClient, dict[str, float]]]:
    """Create a cluster from ``spec_yaml`` under ``home``, wait for its nodes (unless it has
    none until a job runs: Slurm), delete it afterwards.

    Yields a client and the timings of bring-up (and, after the block, tear-down). With
    ``keep_logs``, the controller and agent logs are copied there before the delete.
    ``create_env`` is set in this process's environment while the controller is started
    (which inherits it, and on Slurm hands it on to every batch job and agent).
    """
    os.environ["TRAINPOD_HOME"] = str(home)
    spec_path = home / f"cluster-{len(list(home.glob('cluster-*.yaml')))}.yaml"
    spec_path.write_text(spec_yaml)
    spec = load_cluster_spec(spec_path)
    paths = ClusterPaths.of(spec.name, home)
    backend = backend_for(spec.backend, paths)
    timings: dict[str, float] = {}
    saved = {k: os.environ.get(k) for k in create_env or {}}
    try:
        t0 = time.monotonic()
        try:
            os.environ.update(create_env or {})
            record = backend.create(spec, spec_path)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        with TrainpodClient(record.url, read_secret(paths.admin_token)) as client:
            if wait_nodes:
                wait_for_idle_nodes(client)
            timings["cluster_up_s"] = time.monotonic() - t0
            yield client, timings
    finally:
        t0 = time.monotonic()
        with signals_ignored():
            try:
                if keep_logs is not None:
                    copy_logs(paths, keep_logs / spec.name)
                    for out in paths.jobs_dir.glob("*/slurm-*.out"):  # Slurm: agents' logs
                        shutil.copyfile(
                            out, keep_logs / spec.name / f"job{out.parent.name}-{out.name}"
                        )
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
def wait_for_end(client: TrainpodClient, job_id: int, timeout_s: float) -> tuple[JobInfo, float]:
    """Poll the job every 10 ms until it ends; return it and the time.time() it was seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.job(job_id)
        if info.state in ENDED:
            return info, time.time()
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {info.state} after {timeout_s:g}s")
        time.sleep(JOB_POLL_S)


def _event(
    events: list[EventInfo],
    kind: str,
    *,
    job_id: int | None = None,
    node: str | None = None,
    **data: Any,
) -> EventInfo | None:
    for e in events:
        if e.kind != kind or (job_id is not None and e.job_id != job_id):
            continue
        if node is not None and e.node != node:
            continue
        if all(e.data.get(k) == v for k, v in data.items()):
            return e
    return None


class EventCursor:
    """The newest event id a cluster has: events after it belong to what comes next."""

    def __init__(self, client: TrainpodClient) -> None:
        self.client = client
        self.last = 0

    def advance(self) -> int:
        while batch := self.client.events(after=self.last, limit=1000):
            self.last = batch[-1].id
        return self.last


def printed_time(client: TrainpodClient, job_id: int) -> float:
    """The timestamp the rank printed, from rank 0's log (retried briefly for a late flush)."""
    text = ""
    for _ in range(50):
        text = client.logs(job_id, rank=0).data.strip()
        if text:
            return float(text.splitlines()[0])
        time.sleep(0.01)
    raise RuntimeError(f"job {job_id}: rank 0's log is empty")


def latency_job(
    client: TrainpodClient,
    spec: JobSpec,
    cursor: EventCursor,
    slurm: PrivateSlurm | None = None,
) -> LatencySample:
    """One trainpod job alone; with ``slurm``, also its Slurm and agent milestones."""
    backend = "local" if slurm is None else "slurm"
    after = cursor.advance()
    t_submit = time.time()
    submitted_info = client.submit(spec)
    t_returned = time.time()
    job_id = submitted_info.id
    timeout_s = JOB_TIMEOUT_S if slurm is None else SLURM_JOB_TIMEOUT_S
    try:
        info, t_seen = wait_for_end(client, job_id, timeout_s)
    except TimeoutError as exc:
        return LatencySample(backend=backend, job_id=job_id, state="timeout", error=str(exc))
    sample = LatencySample(backend=backend, job_id=job_id, state=info.state, external=info.external)
    sample.submit_returned_s = t_returned - t_submit
    sample.submit_to_completed_observed_s = t_seen - t_submit
    slurm_done = None
    if slurm is not None and info.external:
        # One at a time: the allocation (and its agent) must be gone before the next job.
        slurm_done = slurm.log.wait(int(info.external), "done", SLURM_JOB_TIMEOUT_S)
        slurm.wait_ended(int(info.external), SLURM_JOB_TIMEOUT_S)
    if info.state != "completed":
        sample.error = info.reason
        return sample
    events = [e for e in client.events(after=after) if e.id > after]
    submitted = _event(events, "job_submitted", job_id=job_id)
    started = _event(events, "rank_started", job_id=job_id, rank=0)
    completed = _event(events, "job_state", job_id=job_id, new="completed")
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
    sample.submit_to_rank_spawned_s = spawned_at - t_submit
    if slurm is not None:
        allocated = _event(events, "node_allocated", job_id=job_id)
        if allocated is not None and allocated.node:
            reg = _event(events, "agent_registered", node=allocated.node)
            if reg is not None:
                sample.submit_to_agent_registered_s = reg.ts - t_submit
        milestones = slurm.log.job(int(info.external)) if info.external else {}
        for key, attr in [
            ("allocated", "submit_to_allocated_s"),
            ("batch_launch", "submit_to_batch_launch_s"),
            ("step_launch", "submit_to_step_launch_s"),
        ]:
            if key in milestones:
                setattr(sample, attr, milestones[key] - t_submit)
        if slurm_done is not None:
            sample.submit_to_slurm_done_s = slurm_done - t_submit
        reg_s, step_s = sample.submit_to_agent_registered_s, sample.submit_to_step_launch_s
        if reg_s is not None and step_s is not None:
            sample.step_launch_to_agent_registered_s = reg_s - step_s
        if sample.submit_to_allocated_s is not None:
            sample.allocated_to_first_instruction_s = (
                sample.submit_to_first_instruction_s - sample.submit_to_allocated_s
            )
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


def interleave(counts: dict[str, int]) -> list[str]:
    """Each backend's jobs spread evenly over one sequence (ties in ``counts`` order)."""
    order = {name: i for i, name in enumerate(counts)}
    slots = [((i + 0.5) / n, order[name], name) for name, n in counts.items() for i in range(n)]
    return [name for _, _, name in sorted(slots)]


class Bench:
    """What the phases need: the clusters' clients, Slurm, the working directory."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.local: TrainpodClient | None = None
        self.slurm_client: TrainpodClient | None = None
        self.slurm: PrivateSlurm | None = None
        self.rng = random.Random(args.seed)

    def spec(self, command: list[str], name: str) -> JobSpec:
        return JobSpec(
            command=command,
            name=name,
            nodes=1,
            procs_per_node=1,
            env=default_env(),
            workdir=str(self.workdir),
        )


def run_latency(
    bench: Bench,
) -> tuple[dict[str, list[LatencySample]], list[float], list[float]]:
    """The latency jobs of every backend, interleaved; a floor start after each local one,
    an agent import (the agent's floor) after each trainpod-on-Slurm one."""
    a = bench.args
    counts = {
        b: a.latency_jobs if b == "local" else a.slurm_latency_jobs
        for b in BACKENDS
        if b in a.backends
    }
    spec = bench.spec(PRINT_TIME, "bench-latency")
    floor_env = {**os.environ, **default_env(), "PYTHONUNBUFFERED": "1"}
    samples: dict[str, list[LatencySample]] = {b: [] for b in counts}
    floors: list[float] = []
    agent_floors: list[float] = []
    cursors: dict[str, EventCursor] = {}
    if bench.local is not None:
        cursors["local"] = EventCursor(bench.local)
    if bench.slurm_client is not None:
        cursors["slurm"] = EventCursor(bench.slurm_client)
    outdir = bench.workdir / "sbatch"
    outdir.mkdir(exist_ok=True)
    for name in interleave(counts):
        if name == "local":
            assert bench.local is not None
            samples[name].append(latency_job(bench.local, spec, cursors[name]))
            floors.append(floor_once(floor_env, bench.workdir))
            continue
        assert bench.slurm is not None
        time.sleep(bench.rng.uniform(0.0, a.gap_s))
        if name == "slurm":
            assert bench.slurm_client is not None
            samples[name].append(latency_job(bench.slurm_client, spec, cursors[name], bench.slurm))
            agent_floors.append(agent_import_once())
        else:
            out = outdir / f"latency-{len(samples[name])}.out"
            samples[name].append(
                sbatch_latency_job(bench.slurm, PRINT_TIME, out, SLURM_JOB_TIMEOUT_S)
            )
    return samples, floors, agent_floors


# -- burst ------------------------------------------------------------------------------------
def run_burst(
    client: TrainpodClient,
    n: int,
    workdir: Path,
    timeout_s: float,
    slurm: PrivateSlurm | None = None,
) -> BurstResult:
    spec = JobSpec(
        command=BURST_COMMAND,
        name="bench-burst",
        nodes=1,
        procs_per_node=1,
        env=default_env(),
        workdir=str(workdir),
    )
    result = BurstResult(
        backend="local" if slurm is None else "slurm", jobs=n, command=BURST_COMMAND
    )
    meter = CpuMeter()
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
    if slurm is not None:
        external = [j.external for j in client.jobs(limit=n) if j.id in ids]
        slurm_burst_tail(slurm, result, external, t_first, timeout_s)
    result.cpu = meter.stop()
    return result


# -- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help="comma-separated, of: local (embedded), slurm (trainpod on Slurm), sbatch",
    )
    p.add_argument("--latency-jobs", type=int, default=30, help="local jobs run one at a time")
    p.add_argument("--burst-jobs", type=int, default=200, help="local jobs submitted at once")
    p.add_argument(
        "--slurm-latency-jobs", type=int, default=25, help="slurm and sbatch jobs, one at a time"
    )
    p.add_argument(
        "--slurm-burst-jobs", type=int, default=40, help="slurm and sbatch jobs submitted at once"
    )
    p.add_argument(
        "--burst-timeout-s", type=float, default=120.0, help="how long to wait for a burst"
    )
    p.add_argument(
        "--gap-s",
        type=float,
        default=1.0,
        help="pause uniform(0, GAP) before each Slurm-backed latency job (Slurm's 1 s passes)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of those pauses")
    p.add_argument(
        "--slurm-dir", type=Path, default=DEFAULT_SLURM_DIR, help="the private Slurm's directory"
    )
    p.add_argument(
        "--slurm-warm-start",
        action="store_true",
        help="keep warm zygotes in trainpod's Slurm agents (default: TRAINPOD_WARM_START=0)",
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    p.add_argument(
        "--keep-logs", type=Path, default=None, help="copy the clusters' logs to this directory"
    )
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(args.backends) - set(BACKENDS))
    if unknown or not args.backends:
        p.error(f"--backends: unknown {unknown}; choose from {','.join(BACKENDS)}")
    counts = [args.latency_jobs, args.burst_jobs, args.slurm_latency_jobs, args.slurm_burst_jobs]
    if min(counts) < 1:
        p.error("the job counts must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    signal.signal(signal.SIGTERM, raise_interrupt)
    home = Path(tempfile.mkdtemp(prefix="trainpod-bench-"))
    results: dict[str, Any] = {
        "benchmark": "dispatch",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["benchmarks/dispatch.py", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "loadavg": {"start": loadavg()},
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("json",)
        },
    }
    backends: dict[str, Any] = {}
    bursts: dict[str, BurstResult] = {}
    bursts_exclusive: dict[str, BurstResult] = {}
    timings: dict[str, dict[str, float]] = {}
    slurm_info: dict[str, Any] = {}
    try:
        workdir = home / "work"
        workdir.mkdir()
        bench = Bench(args, workdir)
        with ExitStack() as stack:
            if {"slurm", "sbatch"} & set(args.backends):
                bench.slurm = stack.enter_context(private_slurm(args.slurm_dir, args.keep_logs))
                nodes = bench.slurm.nodes()
                slurm_info = {
                    "dir": str(args.slurm_dir),
                    "version": bench.slurm.version(),
                    "nodes": nodes,
                    "cpus_per_node": bench.slurm.cpus_per_node(),
                    "agent_warm_start": "1" if args.slurm_warm_start else "0",
                    "timings": bench.slurm.timings,
                }
            if "local" in args.backends:
                bench.local, timings["local"] = stack.enter_context(
                    throwaway_cluster(home, SPEC_YAML, keep_logs=args.keep_logs)
                )
            if "slurm" in args.backends:
                assert bench.slurm is not None
                spec = SLURM_SPEC_YAML.format(
                    name=SLURM_CLUSTER,
                    conf=bench.slurm.conf,
                    count=len(slurm_info["nodes"]),
                    nodes=f"node[1-{len(slurm_info['nodes'])}]",
                )
                env = {"SLURM_CONF": str(bench.slurm.conf)}
                if not args.slurm_warm_start:
                    env["TRAINPOD_WARM_START"] = "0"
                bench.slurm_client, timings["slurm"] = stack.enter_context(
                    throwaway_cluster(
                        home, spec, keep_logs=args.keep_logs, create_env=env, wait_nodes=False
                    )
                )
            print(f"latency phase: backends {','.join(args.backends)}", flush=True)
            samples, floors, agent_floors = run_latency(bench)
            results["loadavg"]["before_bursts"] = loadavg()
            for name in args.backends:
                print(f"burst phase: {name}", flush=True)
                if bench.slurm is not None:
                    bench.slurm.wait_quiet()
                if name == "local":
                    assert bench.local is not None
                    bursts[name] = run_burst(
                        bench.local, args.burst_jobs, workdir, args.burst_timeout_s
                    )
                elif name == "slurm":
                    assert bench.slurm_client is not None
                    bursts[name] = run_burst(
                        bench.slurm_client,
                        args.slurm_burst_jobs,
                        workdir,
                        args.burst_timeout_s,
                        bench.slurm,
                    )
                else:
                    assert bench.slurm is not None
                    bursts[name] = sbatch_burst(
                        bench.slurm, args.slurm_burst_jobs, args.burst_timeout_s
                    )
                    print("burst phase: sbatch --exclusive", flush=True)
                    bench.slurm.wait_quiet()
                    bursts_exclusive[name] = sbatch_burst(
                        bench.slurm, args.slurm_burst_jobs, args.burst_timeout_s, exclusive=True
                    )
            results["loadavg"]["end"] = loadavg()
    finally:
        with signals_ignored():
            shutil.rmtree(home, ignore_errors=True)
    for name in args.backends:
        backends[name] = {
            "latency": latency_results(
                samples[name],
                floors if name == "local" else None,
                agent_floors if name == "slurm" else None,
            ),
            "burst": asdict(bursts[name]),
        }
        if name in bursts_exclusive:
            backends[name]["burst_exclusive"] = asdict(bursts_exclusive[name])
        if name in timings:
            cluster = CLUSTER if name == "local" else SLURM_CLUSTER
            backends[name]["cluster"] = {"name": cluster, **timings[name]}
    if slurm_info:
        slurm_info["slurm_up_s"] = slurm_info["timings"].get("slurm_up_s", float("nan"))
        results["slurm_cluster"] = slurm_info
    results["backends"] = backends
    results["comparison"] = comparison_ = comparison(backends)
    if "local" in backends:
        p50 = comparison_["local"]["latency_p50_s"]
        results["target"] = {"p50_limit_s": TARGET_P50_S, "p50_s": p50, "pass": p50 < TARGET_P50_S}
    results["run_time_s"] = time.monotonic() - t_start
    print(render(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(json_safe(results), indent=2) + "\n")
    print(f"results: {args.json}")
    failed = sum(
        r["latency"]["failed"] + r["burst"]["failed"] + r["burst"]["unfinished"]
        for r in backends.values()
    )
    if failed:
        print(f"{failed} job(s) did not complete", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; the benchmark clusters were deleted", file=sys.stderr)
        sys.exit(130)
