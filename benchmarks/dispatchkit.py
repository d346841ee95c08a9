"""The Slurm side of the dispatch benchmark, and what its three backends share.

* :class:`PrivateSlurm` / :func:`private_slurm`: a throwaway Slurm (``scripts/slurm-ci up``,
  4 nodes x 8 CPUs) that is always stopped and removed again (``down --purge``).
* :class:`SlurmLog`: per-job milestones with millisecond timestamps from slurmctld's and the
  slurmds' logs (submitted, allocated, batch script launched, step launched, done). Slurm
  22.05 has no accounting here (no slurmdbd) and ``squeue --json`` times are whole seconds.
* Plain ``sbatch``: :func:`sbatch_latency_job` and :func:`sbatch_burst`.
* :class:`LatencySample`, :class:`BurstResult`, :func:`summary`, :class:`CpuMeter`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from benchkit import percentile, signals_ignored

REPO = Path(__file__).resolve().parents[1]
SLURM_CI = REPO / "scripts" / "slurm-ci"
#: squeue --json job states after which a job never runs again.
SLURM_ENDED = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "PREEMPTED"}
)
SLURM_CMD_TIMEOUT_S = 30.0
LOG_POLL_S = 0.005
SQUEUE_POLL_S = 0.2


# -- statistics -------------------------------------------------------------------------------
def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "max": max(values) if values else float("nan"),
    }


class CpuMeter:
    """Busy CPU time of the whole machine (``/proc/stat``) between start and stop: every
    tenant's, not only the benchmark's; the load average says how busy the box was."""

    def __init__(self) -> None:
        self._start = self._read()
        self._t0 = time.monotonic()

    @staticmethod
    def _read() -> tuple[float, float]:
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        except OSError:
            return 0.0, 0.0
        ticks = [int(f) for f in fields]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        hz = os.sysconf("SC_CLK_TCK")
        return (sum(ticks) - idle) / hz, sum(ticks) / hz

    def stop(self) -> dict[str, float]:
        busy0, total0 = self._start
        busy1, total1 = self._read()
        wall = time.monotonic() - self._t0
        busy = busy1 - busy0
        return {
            "wall_s": wall,
            "busy_cpu_s": busy,
            "busy_fraction": busy / (total1 - total0) if total1 > total0 else float("nan"),
            "loadavg_1m_after": os.getloadavg()[0],
        }


# -- results ----------------------------------------------------------------------------------
@dataclass
class LatencySample:
    """One job run alone. Times are seconds after the client's ``time.time()`` just before
    the submit, unless the name says otherwise; None where a backend has no such milestone."""

    backend: str
    job_id: int  # trainpod's job id, or Slurm's for plain sbatch
    state: str
    external: str = ""  # the Slurm job id behind a trainpod job
    submit_to_first_instruction_s: float | None = None  # (a) client clock -> rank's clock
    submit_to_spawn_s: float | None = None  # (b) job_submitted.ts -> rank_started.started_at
    submit_to_completed_s: float | None = None  # (c) client submit -> completed (event/log)
    submit_to_completed_observed_s: float | None = None  # (c) as the polling client saw it
    http_submit_s: float | None = None  # client submit -> job_submitted.ts
    spawn_to_first_instruction_s: float | None = None  # Popen in the agent -> rank's print
    # milestones from submit (Slurm-backed backends)
    submit_returned_s: float | None = None  # the submit call returned (HTTP incl. sbatch)
    submit_to_allocated_s: float | None = None  # slurmctld allocated the nodes
    submit_to_batch_launch_s: float | None = None  # slurmd launched the batch script
    submit_to_step_launch_s: float | None = None  # slurmd launched the agent's srun step
    submit_to_agent_registered_s: float | None = None  # the agent's first heartbeat (event)
    submit_to_rank_spawned_s: float | None = None  # rank_started.started_at (agent's clock)
    submit_to_slurm_done_s: float | None = None  # slurmctld: the Slurm job is done
    step_launch_to_agent_registered_s: float | None = None  # the agent's start-up
    allocated_to_first_instruction_s: float | None = None  # all but Slurm's scheduling wait
    error: str = ""


@dataclass
class BurstResult:
    backend: str
    jobs: int
    command: list[str]
    submit_s: float = 0.0
    first_submit_to_last_completion_s: float = 0.0
    submit_rate_jobs_s: float = 0.0
    submit_call_s: dict[str, float] = field(default_factory=dict)  # one submit call
    dispatch_complete_rate_jobs_s: float = 0.0
    completed: int = 0
    failed: int = 0
    unfinished: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    # Slurm-backed backends
    first_submit_to_all_slurm_done_s: float | None = None  # slurmctld: last job done
    observed_all_ended_s: float | None = None  # the polling client saw every job ended
    peak_running_slurm_jobs: int | None = None  # most allocations held at once (logs)
    scheduler_passes: int | None = None  # distinct seconds in which slurmctld started jobs
    cpu: dict[str, float] = field(default_factory=dict)  # CpuMeter over the burst


# -- Slurm's logs -----------------------------------------------------------------------------
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})\] (.*)$")
_CTLD = [
    ("submitted", re.compile(r"_slurm_rpc_submit_batch_job: JobId=(\d+)\b")),
    ("allocated", re.compile(r"(?:sched: Allocate|_start_job: Started) JobId=(\d+)\b")),
    ("done", re.compile(r"_job_complete: JobId=(\d+) done")),
]
_SLURMD = [
    ("batch_launch", re.compile(r"Launching batch job (\d+) for UID")),
    ("step_launch", re.compile(r"launch task StepId=(\d+)\.0 request")),
]


class SlurmLog:
    """Milestones per Slurm job id, read incrementally from slurmctld.log and slurmd-*.log
    (Slurm's default ``LogTimeFormat=iso8601_ms``, local time: the same clock as ours)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self.jobs: dict[int, dict[str, float]] = {}

    def refresh(self) -> None:
        files = [self.log_dir / "slurmctld.log", *sorted(self.log_dir.glob("slurmd-*.log"))]
        for path in files:
            rules = _CTLD if path.name == "slurmctld.log" else _SLURMD
            try:
                with path.open("rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    chunk = f.read()
            except OSError:
                continue
            self._offsets[path] = self._offsets.get(path, 0) + len(chunk)
            text = self._partial.pop(path, "") + chunk.decode(errors="replace")
            lines = text.split("\n")
            if lines[-1]:
                self._partial[path] = lines[-1]
            for line in lines[:-1]:
                self._parse(line, rules)

    def _parse(self, line: str, rules: list[tuple[str, re.Pattern[str]]]) -> None:
        m = _STAMP.match(line)
        if m is None:
            return
        for kind, rx in rules:
            hit = rx.search(m.group(2))
            if hit is not None:
                ts = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f").timestamp()
                self.jobs.setdefault(int(hit.group(1)), {}).setdefault(kind, ts)
                return

    def job(self, job_id: int) -> dict[str, float]:
        self.refresh()
        return self.jobs.get(job_id, {})

    def wait(self, job_id: int, kind: str, timeout_s: float) -> float | None:
        """The time of ``kind`` for the job, waiting up to ``timeout_s`` for it."""
        deadline = time.monotonic() + timeout_s
        while True:
            ts = self.job(job_id).get(kind)
            if ts is not None or time.monotonic() > deadline:
                return ts
            time.sleep(LOG_POLL_S * 4)

    def burst_shape(self, ids: list[int]) -> tuple[int, int]:
        """(most of ``ids`` allocated at once, distinct seconds in which they were started)."""
        self.refresh()
        edges: list[tuple[float, int]] = []
        ticks: set[int] = set()
        for i in ids:
            j = self.jobs.get(i, {})
            if "allocated" in j:
                edges.append((j["allocated"], 1))
                ticks.add(int(j["allocated"]))
                if "done" in j:
                    edges.append((j["done"], -1))
        peak = running = 0
        for _, step in sorted(edges):
            running += step
            peak = max(peak, running)
        return peak, len(ticks)


# -- a private Slurm --------------------------------------------------------------------------
class PrivateSlurm:
    def __init__(self, cluster_dir: Path) -> None:
        self.dir = cluster_dir
        self.conf = cluster_dir / "slurm.conf"
        self.log = SlurmLog(cluster_dir / "log")
        self.timings: dict[str, float] = {}

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def nodes(self) -> list[str]:
        return [
            line.split()[0].removeprefix("NodeName=")
            for line in self.conf.read_text().splitlines()
            if line.startswith("NodeName=")
        ]

    def cpus_per_node(self) -> int:
        m = re.search(r" CPUs=(\d+)", self.conf.read_text())
        return int(m.group(1)) if m else 0

    def run(self, *argv: str) -> str:
        proc = subprocess.run(
            list(argv),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=SLURM_CMD_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"`{shlex.join(argv)}` exited {proc.returncode}: {proc.stderr}")
        return proc.stdout

    def sbatch(self, *args: str) -> int:
        return int(self.run("sbatch", "--parsable", *args).strip().split(";")[0])

    def squeue(self) -> dict[int, dict[str, Any]]:
        """Every job slurmctld knows (finished ones too, for MinJobAge), by id."""
        data = json.loads(self.run("squeue", "--json"))
        if [e for e in data.get("errors", []) if e]:
            raise RuntimeError(f"squeue --json reported: {data['errors']}")
        return {int(j["job_id"]): j for j in data.get("jobs", [])}

    def wait_ended(self, job_id: int, timeout_s: float) -> str:
        """The job's final state from ``squeue --json``, once it has one (slurmctld logs
        "done" while the job may still show COMPLETING for a moment)."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = str(self.squeue().get(job_id, {}).get("job_state", "?"))
            if state in SLURM_ENDED or time.monotonic() > deadline:
                return state
            time.sleep(SQUEUE_POLL_S / 4)

    def wait_quiet(self, timeout_s: float = 60.0) -> None:
        """Wait until no job is pending or running (the previous phase left nothing)."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = [i for i, j in self.squeue().items() if j["job_state"] not in SLURM_ENDED]
            if not live:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm jobs {live[:10]} still live after {timeout_s:g}s")
            time.sleep(SQUEUE_POLL_S)

    def version(self) -> str:
        try:
            return self.run("sinfo", "--version").strip()
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            return "?"


def _slurm_ci(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SLURM_CI), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@contextmanager
def private_slurm(cluster_dir: Path, keep_logs: Path | None = None) -> Iterator[PrivateSlurm]:
    """``slurm-ci up --dir DIR`` (installs Slurm if needed); always ``down --purge`` after,
    on errors and Ctrl-C too. A DIR left by an aborted run is purged first."""
    slurm = PrivateSlurm(cluster_dir)
    try:
        if cluster_dir.exists():
            print(f"slurm: removing {cluster_dir} left by an earlier run", flush=True)
            with signals_ignored():
                _slurm_ci("down", "--purge", "--dir", str(cluster_dir), timeout_s=120)
        t0 = time.monotonic()
        up = _slurm_ci("up", "--dir", str(cluster_dir))
        if up.returncode != 0:
            raise RuntimeError(
                f"scripts/slurm-ci up failed (exit {up.returncode}; `--backends local` runs "
                f"without Slurm):\n{up.stdout}"
            )
        slurm.timings["slurm_up_s"] = time.monotonic() - t0
        yield slurm
    finally:
        t0 = time.monotonic()
        with signals_ignored():
            if keep_logs is not None and (cluster_dir / "log").is_dir():
                shutil.copytree(cluster_dir / "log", keep_logs / "slurm", dirs_exist_ok=True)
            down = _slurm_ci("down", "--purge", "--dir", str(cluster_dir), timeout_s=120)
        slurm.timings["slurm_down_s"] = time.monotonic() - t0
        if down.returncode != 0:
            print(f"warning: scripts/slurm-ci down failed:\n{down.stdout}", flush=True)


def agent_import_once() -> float:
    """Wall time of ``python -c 'import trainpod.agent.main'``: the least an agent costs to
    start (the interpreter and the agent's imports), under the same load as the jobs."""
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import trainpod.agent.main"],
        stdin=subprocess.DEVNULL,
        check=True,
        timeout=SLURM_CMD_TIMEOUT_S,
    )
    return time.perf_counter() - t0


# -- plain sbatch -----------------------------------------------------------------------------
def _read_float(path: Path) -> float | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        return float(text.splitlines()[0]) if text else None
    except ValueError:
        return None


def sbatch_latency_job(
    slurm: PrivateSlurm, command: list[str], out: Path, timeout_s: float
) -> LatencySample:
    """``sbatch --wrap COMMAND --output OUT`` alone: submit -> the timestamp it printed."""
    t_submit = time.time()
    job = slurm.sbatch("--job-name=bench-latency", f"--output={out}", "--wrap", shlex.join(command))
    sample = LatencySample(backend="sbatch", job_id=job, state="?", external=str(job))
    sample.submit_returned_s = time.time() - t_submit
    deadline = time.monotonic() + timeout_s
    printed = None
    while printed is None:
        printed = _read_float(out)
        if printed is None and time.monotonic() > deadline:
            sample.state = "timeout"
            sample.error = f"no timestamp in {out} after {timeout_s:g}s"
            return sample
        if printed is None:
            time.sleep(LOG_POLL_S)
    sample.submit_to_first_instruction_s = printed - t_submit
    done = slurm.log.wait(job, "done", timeout_s)
    sample.submit_to_completed_observed_s = time.time() - t_submit
    state = slurm.wait_ended(job, timeout_s)
    sample.state = "completed" if state == "COMPLETED" else state.lower()
    if state != "COMPLETED":
        sample.error = f"Slurm job {job} is {state}"
    milestones = slurm.log.job(job)
    if done is not None:
        sample.submit_to_completed_s = sample.submit_to_slurm_done_s = done - t_submit
    if "allocated" in milestones:
        sample.submit_to_allocated_s = milestones["allocated"] - t_submit
        sample.allocated_to_first_instruction_s = printed - milestones["allocated"]
    if "batch_launch" in milestones:
        sample.submit_to_batch_launch_s = milestones["batch_launch"] - t_submit
    return sample


def sbatch_burst(
    slurm: PrivateSlurm, n: int, timeout_s: float, *, exclusive: bool = False
) -> BurstResult:
    """``n`` times ``sbatch --wrap true`` back to back, then ``squeue --json`` every 0.2 s
    until all have ended. With ``exclusive``, ``--exclusive``: one job per node, as
    trainpod's Slurm jobs get."""
    extra = ["--exclusive"] if exclusive else []
    command = ["sbatch", *extra, "--wrap", "true"]
    result = BurstResult(backend="sbatch", jobs=n, command=command)
    meter = CpuMeter()
    ids: list[int] = []
    calls: list[float] = []
    t_first = time.time()
    for _ in range(n):
        t0 = time.perf_counter()
        ids.append(slurm.sbatch("--job-name=bench-burst", "--output=/dev/null", *command[1:]))
        calls.append(time.perf_counter() - t0)
    result.submit_s = time.time() - t_first
    result.submit_call_s = summary(calls)
    deadline = time.monotonic() + timeout_s
    wanted = set(ids)
    ended: dict[int, str] = {}
    while True:
        for job_id, j in slurm.squeue().items():
            if job_id in wanted and j["job_state"] in SLURM_ENDED:
                ended[job_id] = j["job_state"]
        if len(ended) == n or time.monotonic() > deadline:
            break
        time.sleep(SQUEUE_POLL_S)
    result.observed_all_ended_s = time.time() - t_first
    result.cpu = meter.stop()
    _finish_slurm_burst(slurm, result, ids, ended, t_first)
    result.first_submit_to_last_completion_s = result.first_submit_to_all_slurm_done_s or 0.0
    if result.unfinished == 0 and result.first_submit_to_last_completion_s > 0:
        result.dispatch_complete_rate_jobs_s = n / result.first_submit_to_last_completion_s
    return result


def _finish_slurm_burst(
    slurm: PrivateSlurm,
    result: BurstResult,
    ids: list[int],
    ended: dict[int, str],
    t_first: float,
) -> None:
    """Counts, failures and the burst's shape from Slurm's logs (``ended``: Slurm states)."""
    n = len(ids)
    if result.backend == "sbatch":
        result.completed = sum(1 for s in ended.values() if s == "COMPLETED")
        result.failed = len(ended) - result.completed
        result.unfinished = n - len(ended)
        result.failures = [
            {"job_id": i, "state": s} for i, s in sorted(ended.items()) if s != "COMPLETED"
        ][:20]
        result.submit_rate_jobs_s = n / result.submit_s if result.submit_s > 0 else 0.0
    slurm.log.refresh()
    dones = [slurm.log.jobs.get(i, {}).get("done") for i in ids]
    if dones and all(d is not None for d in dones):
        result.first_submit_to_all_slurm_done_s = max(d for d in dones if d) - t_first
    result.peak_running_slurm_jobs, result.scheduler_passes = slurm.log.burst_shape(ids)


def slurm_burst_tail(
    slurm: PrivateSlurm, result: BurstResult, external: list[str], t_first: float, timeout_s: float
) -> None:
    """After a trainpod-on-Slurm burst: wait for Slurm to end the allocations, then record
    when the last one was released and the burst's shape."""
    ids = [int(e) for e in external if e]
    deadline = time.monotonic() + timeout_s
    ended: dict[int, str] = {}
    while True:
        for job_id, j in slurm.squeue().items():
            if job_id in ids and j["job_state"] in SLURM_ENDED:
                ended[job_id] = j["job_state"]
        if len(ended) == len(ids) or time.monotonic() > deadline:
            break
        time.sleep(SQUEUE_POLL_S)
    result.observed_all_ended_s = time.time() - t_first
    _finish_slurm_burst(slurm, result, ids, ended, t_first)
    bad = {i: s for i, s in ended.items() if s != "COMPLETED"}
    if bad:
        result.failures.append({"slurm_jobs_not_completed": dict(list(bad.items())[:20])})
