"""The controller ``kill -9``'d under load, and a client's ledger checked against the store
afterwards (ADR 0034; tests/stress/test_controller_kills.py, benchmarks/reliability_kills.py).

A :class:`KillLoad` drives a real local cluster: one thread keeps ``queued`` short jobs
waiting (``true`` and short ``sleep``s) and cancels some, one tails the job list and the
event log, and the caller's thread kills the controller at random instants and restarts it
the way ``trainpod cluster start`` does (``LocalBackend.start``, given as ``restart``). A
few long-running jobs hold nodes the whole time: their workers must be the same processes
at the end. With ``fault_every_s``, a third thread injects faults meanwhile: some of the
short jobs are "faulted" jobs (``sleep 2``, ``--auto-resume``), and every so often one of
them that runs gets a ``kill-worker`` through the chaos API; each must end ``completed``
(restarted after its fault, never cancelled). The :class:`Ledger` keeps every accepted
submission (an id was returned), every state the client saw each job in, every event it
read and every fault the controller accepted; :func:`audit` compares it with the store.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from trainpod.api.models import ChaosRequest, EventInfo, JobInfo
from trainpod.client.http import TrainpodClient
from trainpod.errors import Conflict, Retryable, TrainpodError
from trainpod.spec.job import JobSpec
from trainpod.testing.wait import wait_until

ENDED = {"completed", "failed", "cancelled"}
REFILL_CHUNK = 50  # jobs submitted between two looks at the queue
CANCELS_PER_LOOK = 5  # at most, of the waiting short jobs (5% of them each look)
_HOLD = (
    'echo $$ > "$0/pid-$TRAINPOD_JOB_ID"; '
    'while [ ! -e "$0/release" ]; do sleep 0.2; done'
)  # a long-running worker: records its pid, runs until released


@dataclass
class Ledger:
    accepted: dict[int, str] = field(default_factory=dict)
    """Job id → its kind ("short" or "long"), for every submission answered with an id."""
    seen: dict[int, list[str]] = field(default_factory=dict)
    """Job id → the states the client saw it in, in order (repeats folded)."""
    events: dict[int, EventInfo] = field(default_factory=dict)
    cancels: int = 0
    cancelled: set[int] = field(default_factory=set)
    """Jobs this client cancelled."""
    faults: dict[int, int] = field(default_factory=dict)
    """Job id → the ``kill-worker`` faults the controller accepted for it."""
    refused_calls: int = 0
    """Calls that met a controller being killed or restarting (retried)."""

    def saw(self, job: JobInfo) -> None:
        states = self.seen.setdefault(job.id, [])
        if not states or states[-1] != job.state.value:
            states.append(job.state.value)


@dataclass
class Audit:
    kills: int
    accepted: int
    events_seen: int
    lost_jobs: list[int]
    unaccepted_jobs: list[int]
    """Jobs in the store that no submission was answered with: a reply lost for good, or a
    retry that made a second job (the client's Idempotency-Key prevents both, ADR 0037)."""
    lost_events: list[int]
    changed_events: list[int]
    event_id_gaps: list[int]
    duplicate_attempts: list[str]
    overlapping_attempts: list[int]
    unexplained_states: list[str]
    long_workers_changed: list[str]
    faults: int = 0
    """``kill-worker`` faults the controller accepted."""
    faulted_jobs_restarted: int = 0
    """Faulted jobs that ran a second attempt (a fault may meet a job just as it ends)."""
    faulted_jobs_not_completed: list[str] = field(default_factory=list)
    running: AtOnce | None = None
    """How many jobs ran at once while the load ran (from the stored attempts)."""
    queued: AtOnce | None = None
    """How many jobs waited at once (submitted → first placed)."""

    @property
    def ok(self) -> bool:
        return not (
            self.lost_jobs
            or self.unaccepted_jobs
            or self.lost_events
            or self.changed_events
            or self.event_id_gaps
            or self.duplicate_attempts
            or self.overlapping_attempts
            or self.unexplained_states
            or self.long_workers_changed
            or self.faulted_jobs_not_completed
        )

    def summary(self) -> str:
        return (
            f"kills survived {self.kills}; jobs accepted {self.accepted}, lost "
            f"{len(self.lost_jobs)}, unaccounted for {len(self.unaccepted_jobs)}; events seen "
            f"by clients {self.events_seen}, lost "
            f"{len(self.lost_events)}, changed {len(self.changed_events)}, id gaps "
            f"{len(self.event_id_gaps)}; duplicate attempts {len(self.duplicate_attempts)}, "
            f"overlapping attempts {len(self.overlapping_attempts)}; unexplained states "
            f"{len(self.unexplained_states)}; long-running workers changed "
            f"{len(self.long_workers_changed)}; faults injected {self.faults} "
            f"({self.faulted_jobs_restarted} jobs restarted), faulted jobs not completed "
            f"{len(self.faulted_jobs_not_completed)}"
            + "".join(f"; {m}" for m in (self.queued, self.running) if m is not None)
        )


@dataclass(frozen=True)
class AtOnce:
    """How many jobs were in some state at once, sampled each second of the load from
    stored spans (for running: each attempt placed → ended)."""

    what: str
    median: float
    p10: float
    max: int
    seconds: int

    def __str__(self) -> str:
        return (
            f"jobs {self.what} at once: median {self.median:g}, p10 {self.p10:g}, max "
            f"{self.max} (over {self.seconds} s)"
        )


def at_once(
    what: str, spans: list[tuple[float, float | None]], start: float, end: float
) -> AtOnce | None:
    """Sample, once a second from ``start`` to ``end`` (wall clock), how many of ``spans``
    (began, ended or None: not yet) were live."""
    closed = [(b, e if e is not None else float("inf")) for b, e in spans]
    counts = []
    t = start
    while t < end:
        counts.append(sum(1 for b, e in closed if b <= t < e))
        t += 1.0
    if not counts:
        return None
    counts.sort()
    return AtOnce(
        what=what,
        median=statistics.median(counts),
        p10=counts[len(counts) // 10],
        max=counts[-1],
        seconds=len(counts),
    )


def waiting_span(job: JobInfo) -> tuple[float, float | None]:
    """Submitted → first placed (or ended without a start: cancelled while it waited)."""
    placed = min((a.created_at for a in job.attempts), default=None)
    return job.submitted_at, placed if placed is not None else job.ended_at


class KillLoad:
    def __init__(
        self,
        controller_pid: Callable[[], int | None],
        restart: Callable[[], list[str]],
        client: TrainpodClient,
        workdir: Path,
        env: dict[str, str],
        *,
        queued: int,
        long_jobs: int,
        seed: int = 0,
        fault_every_s: float = 0.0,
        short_max_s: float = 0.3,
        true_fraction: float = 0.7,
    ) -> None:
        """``short_max_s``: a short job is ``true`` or sleeps up to this long (0.3: ``sleep
        0.3``; longer short jobs keep more nodes busy at once). ``true_fraction``: the share
        of short jobs that are ``true``; fewer, and the nodes drain the queue more slowly than
        one client refills it, so it stays near ``queued``."""
        if not 0.0 <= true_fraction <= 1.0:
            raise ValueError(f"true_fraction must be between 0 and 1, not {true_fraction}")
        self.controller_pid = controller_pid
        self.restart = restart
        """Starts what of the cluster is down (``LocalBackend.start``: `trainpod cluster
        start`); returns the names of what it started."""
        self.client = client
        self.workdir = workdir
        self.env = env
        self.queued = queued
        self.long_jobs = long_jobs
        self.fault_every_s = fault_every_s
        self.short_max_s = short_max_s
        self.true_fraction = true_fraction
        self.began = 0.0
        self.ended = 0.0
        """Wall-clock span of the load (:meth:`start` to :meth:`finish`)."""
        self.rng = random.Random(seed)
        self.fault_rng = random.Random(seed + 1)  # its own: the faulter runs in its own thread
        self.ledger = Ledger()
        self.kills = 0
        self.long_pids: dict[int, int] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_event = 0
        self.hold_dir = workdir / "hold"
        self.hold_dir.mkdir(parents=True, exist_ok=True)

    # -- the load --------------------------------------------------------------------------
    def _spec(self, command: list[str], name: str, **extra: Any) -> JobSpec:
        return JobSpec(command=command, env=self.env, workdir=str(self.workdir), name=name, **extra)

    def start(self) -> None:
        """Start the long-running jobs, wait for their workers, then start the load."""
        for _ in range(self.long_jobs):
            job = self.client.submit(self._spec(["sh", "-c", _HOLD, str(self.hold_dir)], "long"))
            self.ledger.accepted[job.id] = "long"
        wait_until(
            lambda: len(list(self.hold_dir.glob("pid-*"))) == self.long_jobs,
            timeout_s=60,
            what=f"{self.long_jobs} long-running workers up",
        )
        for f in self.hold_dir.glob("pid-*"):
            self.long_pids[int(f.name.removeprefix("pid-"))] = int(f.read_text())
        for _ in range(self.queued):  # the queue full before the first kill
            self._submit_one()
        self.began = time.time()
        targets = [self._submitter, self._observer]
        if self.fault_every_s > 0:
            targets.append(self._faulter)
        for target in targets:
            t = threading.Thread(target=target, name=target.__name__, daemon=True)
            t.start()
            self._threads.append(t)

    def _submitter(self) -> None:
        while not self._stop.is_set():
            try:
                waiting = [j for j in self.client.jobs(include_ended=False) if j.state == "queued"]
                # A few cancels a look, and the queue refilled a chunk at a time: a refill of
                # hundreds blocks through restarts for minutes, with no cancel meanwhile.
                shorts = [j for j in waiting if self.ledger.accepted.get(j.id) == "short"]
                doomed = [j for j in shorts if self.rng.random() < 0.05]
                for j in doomed[:CANCELS_PER_LOOK]:
                    self._cancel(j.id)
                for _ in range(min(REFILL_CHUNK, max(0, self.queued - len(waiting)))):
                    self._submit_one()
            except Retryable:
                self.ledger.refused_calls += 1
                self._stop.wait(0.2)
            self._stop.wait(0.1)

    def _submit_one(self) -> None:
        """Submit the next job of the mix; a call the controller does not answer (being
        killed, or restarting longer than the client's own retries) is sent again with the
        same Idempotency-Key until it is, as a careful client would: once sent, a job may
        exist, and only its key can tell (ADR 0037)."""
        if self.fault_every_s > 0 and self.rng.random() < 0.1:
            spec = self._spec(["sleep", "2"], "faulted", auto_resume=True, max_restarts=100)
            kind = "faulted"
        else:
            cmd = ["true"] if self.rng.random() < self.true_fraction else self._sleep()
            spec, kind = self._spec(cmd, "short"), "short"
        key = str(uuid.uuid4())
        while True:
            try:
                job = self.client.submit(spec, idempotency_key=key)
                break
            except Retryable:
                self.ledger.refused_calls += 1
                time.sleep(0.2)
        self.ledger.accepted[job.id] = kind
        self.ledger.saw(job)

    def _sleep(self) -> list[str]:
        if self.short_max_s <= 0.3:
            return ["sleep", "0.3"]
        return ["sleep", f"{self.rng.uniform(0.3, self.short_max_s):.1f}"]

    def _cancel(self, job_id: int) -> None:
        try:
            self.ledger.saw(self.client.cancel(job_id))
            self.ledger.cancels += 1
            self.ledger.cancelled.add(job_id)
        except Conflict:  # it started or ended meanwhile
            pass

    def _faulter(self) -> None:
        """Every ~``fault_every_s``: a ``kill-worker`` on the node of a running faulted job."""
        while not self._stop.wait(self.fault_rng.uniform(0.5, 1.5) * self.fault_every_s):
            try:
                running = [
                    j
                    for j in self.client.jobs(include_ended=False)
                    if j.state == "running" and self.ledger.accepted.get(j.id) == "faulted"
                ]
                if not running:
                    continue
                job = self.fault_rng.choice(running)
                nodes = job.attempts[-1].nodes if job.attempts else []
                if not nodes:
                    continue
                self.client.chaos(ChaosRequest(node=nodes[0], fault="kill-worker"))
                self.ledger.faults[job.id] = self.ledger.faults.get(job.id, 0) + 1
            except Retryable:
                self.ledger.refused_calls += 1
            except TrainpodError:  # the job ended or moved meanwhile: no fault this time
                pass

    def _observer(self) -> None:
        while not self._stop.is_set():
            try:
                self.observe()
            except Retryable:
                self.ledger.refused_calls += 1
            self._stop.wait(0.3)

    def observe(self) -> None:
        for j in self.client.jobs(include_ended=True):
            if j.id in self.ledger.accepted:
                self.ledger.saw(j)
        while True:
            page = self.client.events(after=self._last_event, limit=2000)
            for e in page:
                self.ledger.events[e.id] = e
                self._last_event = e.id
            if len(page) < 2000:
                return

    # -- the kills -------------------------------------------------------------------------
    def kill_controller(self) -> None:
        """``kill -9`` the controller, wait until it is gone, start it again."""
        pid = self.controller_pid()
        assert pid is not None, "no controller pid file"
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(pid), timeout_s=30, what=f"controller {pid} gone")
        self.kills += 1
        started = self.restart()
        assert started == ["controller"], f"restarted {started}: only the controller died"

    def run_kills(self, kills: int, min_gap_s: float, max_gap_s: float) -> None:
        for _ in range(kills):
            time.sleep(self.rng.uniform(min_gap_s, max_gap_s))
            self.kill_controller()

    def finish(self, timeout_s: float = 120.0) -> None:
        """Stop the load, cancel what waits, release the long jobs, wait until all ended."""
        self.ended = time.time()
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        for job_id in self.long_pids:
            assert _alive(self.long_pids[job_id]), f"job {job_id}'s worker died"
        for j in self.client.jobs(include_ended=False):
            if j.state == "queued":
                self._cancel(j.id)
        (self.hold_dir / "release").touch()
        wait_until(
            lambda: not self.client.jobs(include_ended=False),
            timeout_s=timeout_s,
            what="every job ended",
        )
        self.observe()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def audit(load: KillLoad) -> Audit:
    """Compare the ledger with what the store holds now."""
    client, ledger = load.client, load.ledger
    jobs = {j.id: j for j in client.jobs(include_ended=True)}
    events: list[EventInfo] = []
    while True:
        page = client.events(after=events[-1].id if events else 0, limit=5000)
        events += page
        if len(page) < 5000:
            break
    by_id = {e.id: e for e in events}
    ids = [e.id for e in events]
    gaps = sorted(set(range(ids[0], ids[-1] + 1)) - set(ids)) if ids else []
    lost_events = [i for i in ledger.events if i not in by_id]
    changed = [
        i
        for i, e in ledger.events.items()
        if i in by_id and by_id[i].model_dump() != e.model_dump()
    ]
    duplicates: list[str] = []
    overlapping: list[int] = []
    started: dict[tuple[int, int | None, int], int] = {}
    for e in events:
        if e.kind == "rank_started" and e.job_id is not None:
            key = (e.job_id, e.attempt, int(e.data.get("rank", -1)))
            started[key] = started.get(key, 0) + 1
    duplicates += [
        f"job {k[0]} attempt {k[1]} rank {k[2]}: {n}" for k, n in started.items() if n > 1
    ]
    for job in jobs.values():
        numbers = [a.number for a in job.attempts]
        if numbers != list(range(1, len(numbers) + 1)):
            duplicates.append(f"job {job.id} attempts {numbers}")
        spans = sorted((a.created_at, a.ended_at) for a in job.attempts)
        for (_, end), (begin, _) in itertools.pairwise(spans):
            if end is None or end > begin:
                overlapping.append(job.id)
    new_states: dict[int, set[str]] = {}
    for e in events:
        if e.kind == "job_state" and e.job_id is not None:
            new_states.setdefault(e.job_id, set()).add(str(e.data.get("new")))
    unexplained = []
    for job_id, states in ledger.seen.items():
        final = jobs.get(job_id)
        if final is None:
            continue
        if states[-1] != final.state.value:
            unexplained.append(f"job {job_id}: last seen {states[-1]}, store {final.state.value}")
        for s in states:
            if s != "queued" and s not in new_states.get(job_id, set()):
                unexplained.append(f"job {job_id}: seen {s}, no job_state event for it")
    changed_workers = []
    for job_id, pid in load.long_pids.items():
        job = jobs[job_id]
        pids = [r.pid for a in job.attempts for r in a.ranks]
        if len(job.attempts) != 1 or pids != [pid]:
            changed_workers.append(f"job {job_id}: worker {pid}, store {pids}")
    faulted = [i for i, kind in ledger.accepted.items() if kind == "faulted" and i in jobs]
    not_completed = [
        f"job {i}: {jobs[i].state.value} ({jobs[i].reason})"
        for i in faulted
        if jobs[i].state.value != "completed"
        and not (i in ledger.cancelled and jobs[i].state.value == "cancelled")
    ]
    return Audit(
        running=at_once(
            "running",
            [(a.created_at, a.ended_at) for j in jobs.values() for a in j.attempts],
            load.began,
            load.ended,
        ),
        queued=at_once("queued", [waiting_span(j) for j in jobs.values()], load.began, load.ended),
        faults=sum(ledger.faults.values()),
        faulted_jobs_restarted=sum(len(jobs[i].attempts) > 1 for i in ledger.faults if i in jobs),
        faulted_jobs_not_completed=not_completed,
        kills=load.kills,
        accepted=len(ledger.accepted),
        events_seen=len(ledger.events),
        lost_jobs=sorted(set(ledger.accepted) - set(jobs)),
        unaccepted_jobs=sorted(set(jobs) - set(ledger.accepted)),
        lost_events=lost_events,
        changed_events=changed,
        event_id_gaps=gaps,
        duplicate_attempts=duplicates,
        overlapping_attempts=sorted(set(overlapping)),
        unexplained_states=unexplained,
        long_workers_changed=changed_workers,
    )
