"""A soak (issue 14 item 6): a real local cluster run for minutes or an hour with a stream of
short jobs, checkpointing training jobs and a fault every ~30 s, its resources sampled
throughout (tests/stress/test_soak.py, ``benchmarks/reliability.py --part soak``).

What is sampled (:class:`Sampler`): the controller's and the agents' memory (RSS), file
descriptors and threads, the controller's native memory by holder (glibc's heaps in use and
free, mapped chunks, SQLite: from its ``/metrics``, ADR 0045), the number of processes under
them (ranks, zygotes, persisters, warm-start servers), the state database's size (with its
log) and what trainpod holds in ``/dev/shm``. :class:`SoakResult` gives each one's growth
per hour (the least-squares slope of its samples) and the leaks found at rest: once every
job has ended, the cluster must be back where it started: no memory tier left in
``/dev/shm``, no process left under the agents, the controller's descriptors and threads
where they were.

Every job goes into a ledger with the state it must end in: training jobs ``completed``,
whatever fault they met; short ones ``completed``; the ones cancelled while running
``cancelled``. Every job is submitted with ``--auto-resume``, so the outcome does not depend
on which job a fault meets: it is aimed (``kill-worker`` or ``xid79`` in turn) at one of a
running training job's nodes, at most once per training job so that its restarts never run
out, but the job may have ended and a short one taken the node by the time it lands.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from trainpod.agent.zygote import SPARE_NAME
from trainpod.api.models import ChaosFault, ChaosRequest, JobInfo
from trainpod.client.http import JOBS_PAGE, TrainpodClient
from trainpod.errors import Conflict, Retryable, TrainpodError
from trainpod.paths import ClusterPaths
from trainpod.spec.job import JobSpec
from trainpod.testing.wait import WaitTimeout, wait_until

SHM_ROOT = Path("/dev/shm/trainpod")
ENDED = {"completed", "failed", "cancelled"}
SPEC = """\
name: {name}
backend: local
instance_groups:
  - name: workers
    count: {workers}
    devices_per_node: 1
  - name: spares
    count: 1
    devices_per_node: 1
    spare: true
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 10
controller:
  view_cache_mib: {view_cache_mib}
"""
"""The soak's cluster: ``workers`` nodes of one (simulated) GPU and a hot spare;
``view_cache_mib``: the controller's read caches' bound (64 by default; a small one shows
the controller's memory level off within the run)."""


def gpt_argv(python: str, examples: Path) -> list[str]:
    """The soak's training job: examples/gpt/train.py at its smallest, 40 steps, a
    trainpod.Checkpointer save (memory tier, then scratch and durable) every 5."""
    return [
        python,
        str(examples / "gpt" / "train.py"),
        *("--steps", "40", "--n-layer", "1", "--n-embd", "32", "--n-head", "2"),
        *("--seq-len", "32", "--batch-size", "2", "--ckpt-every", "5", "--log-every", "10"),
    ]


@dataclass(frozen=True)
class Usage:
    """Processes' resources, summed."""

    rss_bytes: int = 0
    fds: int = 0
    threads: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.rss_bytes + other.rss_bytes, self.fds + other.fds, self.threads + other.threads
        )


@dataclass(frozen=True)
class Native:
    """The controller's native memory by holder, in bytes (``/metrics``:
    :mod:`trainpod.telemetry.allocator`); NaN where it serves none."""

    malloc_in_use: float = math.nan
    malloc_free: float = math.nan
    malloc_mmap: float = math.nan
    sqlite: float = math.nan

    @classmethod
    def parse(cls, text: str) -> Native:
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "trainpod_process_malloc_bytes":
                    found[f"malloc_{s.labels['kind']}"] = s.value
                elif s.name == "trainpod_process_sqlite_memory_bytes":
                    found["sqlite"] = s.value
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in found.items() if k in names})


@dataclass(frozen=True)
class Sample:
    t: float
    controller: Usage
    agents: Usage
    """The agent daemons themselves (one per node), summed."""
    processes: int
    """Every process under the agents (ranks, zygotes, persisters, warm-start servers) but
    the zygotes' spares."""
    spares: int
    """Zygotes' spares waiting under the agents (at most one per zygote)."""
    db_bytes: int
    """The state database with its write-ahead log."""
    shm_bytes: int
    shm_dirs: frozenset[str]
    """Jobs' memory tiers in /dev/shm/trainpod (other clusters' too: compare with a baseline)."""
    native: Native = Native()
    """The controller's native memory (NaN: not read, e.g. while it restarts)."""


MEASURES: dict[str, Callable[[Sample], float]] = {
    "controller_rss_mib": lambda s: s.controller.rss_bytes / 2**20,
    "controller_fds": lambda s: s.controller.fds,
    "controller_threads": lambda s: s.controller.threads,
    "controller_malloc_in_use_mib": lambda s: s.native.malloc_in_use / 2**20,
    "controller_malloc_free_mib": lambda s: s.native.malloc_free / 2**20,
    "controller_malloc_mmap_mib": lambda s: s.native.malloc_mmap / 2**20,
    "controller_sqlite_mib": lambda s: s.native.sqlite / 2**20,
    "agents_rss_mib": lambda s: s.agents.rss_bytes / 2**20,
    "agents_fds": lambda s: s.agents.fds,
    "agents_threads": lambda s: s.agents.threads,
    "db_mib": lambda s: s.db_bytes / 2**20,
    "shm_mib": lambda s: s.shm_bytes / 2**20,
}


def _usage(pid: int | None) -> Usage:
    if pid is None:
        return Usage()
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return Usage(p.memory_info().rss, p.num_fds(), p.num_threads())
    except psutil.Error:  # it died between the pid file and the look (a node being repaired)
        return Usage()


def _descendants(pid: int | None) -> tuple[int, int]:
    """(processes, spares) under ``pid``: a zygote's spare (one forked ahead of the next
    rank, ``trainpod.agent.zygote.SPARE_NAME``) is counted apart, since a zygote forks it
    whenever it is idle, at rest too."""
    if pid is None:
        return 0, 0
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return 0, 0
    spares = 0
    for kid in kids:
        with contextlib.suppress(psutil.Error):  # ended meanwhile: counted as a process
            spares += kid.name() == SPARE_NAME
    return len(kids) - spares, spares


def _tree_bytes(root: Path) -> tuple[int, frozenset[str]]:
    """(bytes, job directories) under ``root``."""
    if not root.is_dir():
        return 0, frozenset()
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:  # removed meanwhile
                pass
    return total, frozenset(p.name for p in root.iterdir() if p.name.startswith("job-"))


class Sampler:
    def __init__(
        self,
        paths: ClusterPaths,
        nodes: Sequence[str],
        pid_of: Callable[[str], int | None],
        shm_root: Path = SHM_ROOT,
        metrics: Callable[[], str] | None = None,
    ) -> None:
        """``pid_of``: a cluster process's pid by name (``controller``, ``agent-<node>``),
        None when it is not running (the local backend's pid files:
        ``trainpod.backends.procs.read_pid``). ``metrics``: the controller's ``/metrics``
        text (``TrainpodClient.metrics``), for its native memory."""
        self.paths = paths
        self.nodes = list(nodes)
        self.pid_of = pid_of
        self.shm_root = shm_root
        self.metrics = metrics

    def _native(self) -> Native:
        if self.metrics is None:
            return Native()
        try:
            return Native.parse(self.metrics())
        except (TrainpodError, ValueError):  # restarting, or a scrape cut short
            return Native()

    def sample(self) -> Sample:
        agents = [self.pid_of(f"agent-{n}") for n in self.nodes]
        under = [_descendants(a) for a in agents]
        db = sum(
            p.stat().st_size
            for p in (self.paths.db, self.paths.db.with_name(self.paths.db.name + "-wal"))
            if p.exists()
        )
        shm_bytes, shm_dirs = _tree_bytes(self.shm_root)
        return Sample(
            t=time.time(),
            controller=_usage(self.pid_of("controller")),
            agents=sum((_usage(a) for a in agents), Usage()),
            processes=sum(p for p, _ in under),
            spares=sum(s for _, s in under),
            db_bytes=db,
            shm_bytes=shm_bytes,
            shm_dirs=shm_dirs,
            native=self._native(),
        )


def growth_per_hour(samples: Sequence[Sample], measure: Callable[[Sample], float]) -> float:
    """The least-squares slope of ``measure`` over ``samples``, per hour (0 with fewer than 3;
    samples where it is NaN, not read, are left out; NaN when it was never read)."""
    points = [(s.t - samples[0].t, float(measure(s))) for s in samples]
    if any(not math.isnan(y) for _, y in points):
        points = [(x, y) for x, y in points if not math.isnan(y)]
    elif points:
        return math.nan
    if len(points) < 3:
        return 0.0
    xs = [x for x, _ in points]
    ys = [y for _, y in points]
    if len(set(ys)) == 1:
        return 0.0
    return statistics.linear_regression(xs, ys).slope * 3600


@dataclass
class SoakLedger:
    expected: dict[int, str] = field(default_factory=dict)
    """Job id -> the state it must end in."""
    kind: dict[int, str] = field(default_factory=dict)
    ended: dict[int, str] = field(default_factory=dict)
    faults: list[tuple[float, str, str, int]] = field(default_factory=list)
    """(when, node, fault, job) for every fault injected."""
    reasons: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SoakResult:
    minutes: float
    nodes: int
    ledger: SoakLedger
    samples: list[Sample]
    baseline: Sample
    """At rest before the first job."""
    final: Sample
    """At rest after the last job ended."""

    def mismatches(self) -> list[str]:
        out = []
        for job_id, want in sorted(self.ledger.expected.items()):
            got = self.ledger.ended.get(job_id, "not ended")
            if got != want:
                why = self.ledger.reasons.get(job_id, "")[:300]
                out.append(f"job {job_id} ({self.ledger.kind[job_id]}): {got}, not {want}: {why}")
        return out

    def growth(self, warmup: float = 0.25) -> dict[str, float]:
        """Growth per hour over the samples after the first ``warmup`` of the run: what a
        cluster takes once (an agent imports torch when it first hosts an attempt's
        rendezvous store, ~200 MB) is not a leak; what still grows after it is."""
        t0, t1 = self.samples[0].t, self.samples[-1].t
        late = [s for s in self.samples if s.t >= t0 + warmup * (t1 - t0)]
        return {name: growth_per_hour(late, m) for name, m in MEASURES.items()}

    def leaks_at_rest(self, *, fd_slack: int = 8, thread_slack: int = 8) -> list[str]:
        """What the cluster holds at rest after the soak that it did not hold before it.
        ``thread_slack``: the controller's pools start threads on demand and keep them
        (uvloop's libuv workers, 4, seen as ``libuv-worker`` in /proc; anyio's for the API's
        blocking routes), so a few more threads at the end are the pools filling, not a
        leak; the long soak's growth per hour tells the two apart."""
        b, f = self.baseline, self.final
        out = []
        if left := sorted(f.shm_dirs - b.shm_dirs):
            out.append(f"memory tiers left in {SHM_ROOT}: {', '.join(left)}")
        if f.processes > b.processes:
            out.append(f"processes under the agents: {b.processes} before, {f.processes} after")
        if f.spares > f.processes:  # each waits under a zygote, itself a process counted
            out.append(f"spares under the agents: {f.spares}, more than their zygotes")
        if f.controller.fds > b.controller.fds + fd_slack:
            out.append(f"controller fds: {b.controller.fds} before, {f.controller.fds} after")
        if f.controller.threads > b.controller.threads + thread_slack:
            out.append(
                f"controller threads: {b.controller.threads} before, {f.controller.threads} after"
            )
        if f.agents.fds > b.agents.fds + fd_slack * self.nodes:
            out.append(f"agents' fds: {b.agents.fds} before, {f.agents.fds} after")
        return out

    def report(self) -> str:
        kinds: dict[str, int] = {}
        for k in self.ledger.kind.values():
            kinds[k] = kinds.get(k, 0) + 1
        lines = [
            f"soak: {self.minutes:g} min, {len(self.ledger.expected)} jobs "
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            + f"; {len(self.ledger.faults)} faults injected; "
            f"{len(self.mismatches())} jobs not in the state their ledger expects",
            "growth per hour (least squares over the samples after the first quarter):",
        ]
        for name, g in self.growth().items():
            first, last = MEASURES[name](self.baseline), MEASURES[name](self.final)
            lines.append(f"  {name:20} {g:+10.2f}/h   at rest: {first:.1f} -> {last:.1f}")
        leaks = self.leaks_at_rest()
        lines.append("leaks at rest: " + ("none" if not leaks else "; ".join(leaks)))
        return "\n".join(lines)


class Soak:
    def __init__(
        self,
        client: TrainpodClient,
        sampler: Sampler,
        workdir: Path,
        env: dict[str, str],
        *,
        train_argv: list[str],
        train_nodes: int = 2,
        faults: Sequence[ChaosFault] = ("kill-worker", "xid79"),
        fault_every_s: float = 30.0,
        short_in_flight: int = 2,
        cancel_every: int = 6,
        sample_every_s: float = 5.0,
        list_every_s: float = 30.0,
        list_page: int | None = JOBS_PAGE,
        seed: int = 0,
    ) -> None:
        """``list_every_s``: how often the whole job list is read, as a dashboard or
        ``trainpod jobs --all`` would (every job the soak has run, ended ones too);
        ``list_page``: jobs per call of that read (None: the whole list in one call)."""
        self.client = client
        self.sampler = sampler
        self.workdir = workdir
        self.env = env
        self.train_argv = train_argv
        self.train_nodes = train_nodes
        self.faults = itertools.cycle(faults)
        self.fault_every_s = fault_every_s
        self.short_in_flight = short_in_flight
        self.cancel_every = cancel_every
        self.sample_every_s = sample_every_s
        self.list_every_s = list_every_s
        self.list_page = list_page
        self.rng = random.Random(seed)
        self.ledger = SoakLedger()
        self._live: dict[int, JobInfo] = {}
        self._faulted: set[int] = set()
        self._to_cancel: set[int] = set()
        self._shorts = 0
        self.listed = 0
        """How many jobs the last full listing had."""
        self.missed = 0
        """Faults the controller refused: the node's ranks had ended since the look (409)."""

    def _submit(self, command: list[str], kind: str, expect: str, **spec: object) -> int:
        job = self.client.submit(
            JobSpec(
                command=command,
                env=self.env,
                workdir=str(self.workdir),
                name=f"soak-{kind}",
                auto_resume=True,
                **spec,
            )
        )
        self.ledger.expected[job.id] = expect
        self.ledger.kind[job.id] = kind
        self._live[job.id] = job
        return job.id

    def run(self, minutes: float) -> SoakResult:
        baseline = self._at_rest()
        samples = [baseline]
        start = time.monotonic()
        deadline = start + minutes * 60
        next_fault = start + self.fault_every_s
        next_sample = start + self.sample_every_s
        next_list = start + self.list_every_s
        while time.monotonic() < deadline:
            try:
                self._feed()
                self._look()
                if time.monotonic() >= next_fault and self._inject():
                    next_fault = time.monotonic() + self.fault_every_s
                if time.monotonic() >= next_list:
                    self.listed = len(self.client.jobs(include_ended=True, page=self.list_page))
                    next_list = time.monotonic() + self.list_every_s
            except Retryable:
                pass  # the controller busy for a moment: next round
            if time.monotonic() >= next_sample:
                samples.append(self.sampler.sample())
                next_sample += self.sample_every_s
            time.sleep(0.25)
        wait_until(self._drained, timeout_s=300, interval_s=0.5, what="every soak job to end")
        final = self._at_rest()
        samples.append(final)
        nodes = len(self.sampler.nodes)
        return SoakResult(minutes, nodes, self.ledger, samples, baseline, final)

    def _feed(self) -> None:
        """Keep one training job and ``short_in_flight`` short ones going."""
        kinds = [self.ledger.kind[j] for j in self._live]
        if "train" not in kinds:
            self._submit(self.train_argv, "train", "completed", nodes=self.train_nodes)
        for _ in range(self.short_in_flight - sum(k != "train" for k in kinds)):
            self._shorts += 1
            if self._shorts % self.cancel_every == 0:
                self._to_cancel.add(self._submit(["sleep", "600"], "cancelled", "cancelled"))
            else:
                cmd = ["true"] if self.rng.random() < 0.5 else ["sleep", "0.5"]
                self._submit(cmd, "short", "completed")

    def _look(self) -> None:
        for job_id in list(self._live):
            job = self.client.job(job_id)
            self._live[job_id] = job
            if job.state in ENDED:
                self.ledger.ended[job_id] = job.state
                self.ledger.reasons[job_id] = job.reason
                del self._live[job_id]
            elif job_id in self._to_cancel and job.state == "running":
                try:
                    self.client.cancel(job_id)
                    self._to_cancel.discard(job_id)
                except Conflict:  # it ended meanwhile
                    pass

    def _inject(self) -> bool:
        """A fault on a running training job's node, once per job; True if injected."""
        for job in self._live.values():
            if self.ledger.kind[job.id] != "train" or job.id in self._faulted:
                continue
            attempt = job.attempts[-1] if job.attempts else None
            if job.state != "running" or attempt is None or attempt.state != "running":
                continue
            node = self.rng.choice(attempt.nodes)
            fault = next(self.faults)
            try:
                self.client.chaos(ChaosRequest(node=node, fault=fault))
            except Conflict:  # its ranks ended or restarted since the look: the next round
                self.missed += 1
                return False
            self._faulted.add(job.id)
            self.ledger.faults.append((time.time(), node, fault, job.id))
            return True
        return False

    def _drained(self) -> bool:
        try:
            self._to_cancel.clear()
            for job_id in list(self._live):
                if self.ledger.kind[job_id] == "cancelled" and job_id not in self.ledger.ended:
                    try:
                        self.client.cancel(job_id)
                    except Conflict:
                        pass
            self._look()
        except Retryable:
            return False
        return not self._live

    def _at_rest(self) -> Sample:
        """A sample once nothing runs: every node idle, and the processes under the agents
        and the memory tiers in /dev/shm the same for a second."""

        def idle() -> bool:
            try:
                nodes = self.client.nodes()
            except Retryable:
                return False
            return all(n.state == "idle" for n in nodes if n.role != "head")

        wait_until(idle, timeout_s=300, interval_s=0.5, what="every node idle")
        last: list[Sample] = []

        def settled() -> Sample | None:
            s = self.sampler.sample()
            prev = last[-1] if last else None
            last.append(s)
            steady = prev is not None and (prev.processes, prev.shm_dirs) == (
                s.processes,
                s.shm_dirs,
            )
            return s if steady else None

        try:
            return wait_until(settled, timeout_s=60, interval_s=1.0, what="the cluster at rest")
        except WaitTimeout:
            return last[-1]  # what it is: leaks_at_rest says what was left
