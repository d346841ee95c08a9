"""The scheduling benchmark's trace and metrics (``benchmarks/scheduling.py``).

Pure code, no processes: the job trace is generated from a seed (its parameters are
:data:`PARAMS`, at the top of this file), the workers' progress logs are parsed into
attempts, and every metric is computed from those by the same functions for both sides
(trainpod's embedded scheduler and Slurm), so a difference between them is the schedulers',
not the measuring's.

Worker log (``benchmarks/workers/trace_job.py``, rank 0 only, one file per trace job, all
attempts appended), one line per event::

    kind=<start|step|notice|saved|done> t=<time.time()> step=<n> nodes=<a,b,..>

``start``: the process started and loaded checkpoint step ``n`` (0: none); ``step``: step
``n`` completed; ``notice``: the preemption notice arrived (``n``: the last completed step);
``saved``: checkpoint ``n`` written on the notice (the process then exits); ``done``: the
job's last step completed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Protocol, TypeVar

from benchmarks.benchkit import percentile

# --------------------------------------------------------------------------- the trace

T = TypeVar("T")


@dataclass(frozen=True)
class TraceParams:
    """What the trace is made of. Lengths are in seconds of steps (``step_s`` each)."""

    seed: int
    jobs: int
    nodes: int
    """Cluster size (1 device per node): job sizes are drawn up to this."""
    arrival_s: float
    """Arrivals form a Poisson process rescaled to span this many seconds."""
    teams: tuple[str, ...]
    """Equal weights, equal quotas (nodes // len(teams) each), each may lend and borrow."""
    class_mix: tuple[tuple[str, float], ...]
    """Priority class -> probability; classes in order, highest first."""
    size_mix: tuple[tuple[int, float], ...]
    """Nodes -> probability."""
    length_median_s: float
    length_sigma: float
    """Lengths are log-normal (median, sigma), clipped to [length_min_s, length_max_s]."""
    length_min_s: float
    length_max_s: float
    step_s: float
    """Seconds of one "training" step (a sleep)."""
    ckpt_every: int
    """A periodic checkpoint every this many steps."""
    time_factor: float
    """``--time`` declared = length x this + ``time_slack_s``, rounded up to whole seconds."""
    time_slack_s: float


PARAMS = TraceParams(
    seed=20261201,
    jobs=200,
    nodes=6,
    arrival_s=180.0,
    teams=("vision", "nlp", "speech"),
    class_mix=(("high", 0.10), ("normal", 0.45), ("low", 0.45)),
    size_mix=((1, 0.60), (2, 0.20), (3, 0.10), (4, 0.07), (6, 0.03)),
    length_median_s=3.0,
    length_sigma=0.7,
    length_min_s=1.0,
    length_max_s=20.0,
    step_s=0.25,
    ckpt_every=8,
    time_factor=1.5,
    time_slack_s=10.0,
)
"""The benchmark's trace: 200 jobs over 3 minutes on 6 nodes, ~1.2x the cluster's capacity
offered while they arrive (so work waits), 10% high, 45% normal, 45% low priority."""

QUICK = replace(PARAMS, jobs=40, arrival_s=40.0)
"""``--quick``: the same mix, 40 jobs over 40 s (a smoke run, not a figure)."""

CLASS_RANK = {"high": 3, "normal": 2, "low": 1}
"""Which class outranks which (the cluster spec's values are 1000/100/10)."""


@dataclass(frozen=True)
class TraceJob:
    index: int
    arrival_s: float
    """Seconds after the replay starts."""
    team: str
    user: str
    """The team's one user in the trace (``<team>-user``)."""
    priority_class: str
    nodes: int
    steps: int
    time_limit: str
    """``--time`` in Slurm's ``MM:SS`` format (trainpod takes the same string)."""


def _pick(rng: random.Random, mix: Sequence[tuple[T, float]]) -> T:
    x = rng.random() * sum(p for _, p in mix)
    for value, p in mix:
        x -= p
        if x < 0:
            return value
    return mix[-1][0]


def _mix_problems(params: TraceParams) -> list[str]:
    out = []
    if params.jobs < 1:
        out.append(f"jobs must be >= 1, got {params.jobs}")
    if params.arrival_s <= 0:
        out.append(f"arrival_s must be > 0, got {params.arrival_s}")
    for name, mix in (("class_mix", params.class_mix), ("size_mix", params.size_mix)):
        if not mix or any(p < 0 for _, p in mix) or sum(p for _, p in mix) <= 0:
            out.append(f"{name} needs at least one value with a positive probability")
    for cls, _ in params.class_mix:
        if cls not in CLASS_RANK:
            out.append(f"class_mix names {cls!r}; use {', '.join(CLASS_RANK)}")
    too_big = [n for n, _ in params.size_mix if not 1 <= n <= params.nodes]
    if too_big:
        out.append(f"size_mix has sizes {too_big} outside 1..nodes ({params.nodes})")
    if not 0 < params.length_min_s <= params.length_max_s:
        out.append("need 0 < length_min_s <= length_max_s")
    if params.step_s <= 0 or params.ckpt_every < 1:
        out.append("need step_s > 0 and ckpt_every >= 1")
    if not params.teams:
        out.append("teams must name at least one team")
    return out


def make_trace(params: TraceParams = PARAMS) -> list[TraceJob]:
    """The trace of ``params``: the same jobs, in arrival order, for the same parameters."""
    problems = _mix_problems(params)
    if problems:
        raise ValueError("bad trace parameters: " + "; ".join(problems))
    rng = random.Random(params.seed)
    gaps = [rng.expovariate(1.0) for _ in range(params.jobs)]
    scale = params.arrival_s / sum(gaps)
    t = 0.0
    jobs = []
    for i, gap in enumerate(gaps):
        arrival = round(t, 3)  # the first job arrives at 0
        t += gap * scale
        team = params.teams[rng.randrange(len(params.teams))]
        cls = _pick(rng, params.class_mix)
        size = _pick(rng, params.size_mix)
        length = params.length_median_s * math.exp(rng.gauss(0.0, params.length_sigma))
        length = min(max(length, params.length_min_s), params.length_max_s)
        steps = max(1, round(length / params.step_s))
        limit = math.ceil(steps * params.step_s * params.time_factor + params.time_slack_s)
        jobs.append(
            TraceJob(
                index=i,
                arrival_s=arrival,
                team=team,
                user=f"{team}-user",
                priority_class=cls,
                nodes=size,
                steps=steps,
                time_limit=f"{limit // 60}:{limit % 60:02d}",
            )
        )
    return jobs


def offered_load(jobs: Sequence[TraceJob], params: TraceParams) -> float:
    """Node-seconds of steps the trace asks for over the capacity while it arrives."""
    work = sum(j.nodes * j.steps * params.step_s for j in jobs)
    span = max(j.arrival_s for j in jobs) or params.arrival_s
    return work / (params.nodes * span)


# --------------------------------------------------------------------------- the logs


@dataclass
class Attempt:
    """One run of a trace job (rank 0's process), from its log lines."""

    started_t: float
    resumed_step: int
    nodes: tuple[str, ...]
    steps: list[tuple[int, float]] = field(default_factory=list)
    notice_t: float | None = None
    saved_step: int | None = None
    saved_t: float | None = None
    done: bool = False
    last_t: float = 0.0

    @property
    def first_step_t(self) -> float | None:
        return self.steps[0][1] if self.steps else None

    def step_t(self, step: int) -> float | None:
        """When this attempt completed ``step`` (None: it did not)."""
        for n, t in self.steps:
            if n == step:
                return t
        return None


def parse_line(line: str) -> dict[str, str]:
    out = {}
    for part in line.split():
        key, sep, value = part.partition("=")
        if sep:
            out[key] = value
    return out


def parse_log(lines: Iterable[str]) -> list[Attempt]:
    """The attempts of one trace job's log (lines before the first ``start`` are ignored;
    a line that is not ``key=value`` pairs with a kind, t and step raises ValueError)."""
    attempts: list[Attempt] = []
    for raw in lines:
        if not raw.strip():
            continue
        f = parse_line(raw)
        try:
            kind, t, step = f["kind"], float(f["t"]), int(f["step"])
        except (KeyError, ValueError):
            raise ValueError(f"not a worker log line (kind=, t=, step=): {raw!r}") from None
        if kind == "start":
            nodes = tuple(n for n in f.get("nodes", "").split(",") if n)
            attempts.append(Attempt(started_t=t, resumed_step=step, nodes=nodes, last_t=t))
            continue
        if not attempts:
            continue
        a = attempts[-1]
        a.last_t = max(a.last_t, t)
        if kind == "step":
            a.steps.append((step, t))
        elif kind == "notice":
            a.notice_t = t
        elif kind == "saved":
            a.saved_step = step
            a.saved_t = t
        elif kind == "done":
            a.done = True
        else:
            raise ValueError(f"unknown kind {kind!r} in worker log line {raw!r}")
    return attempts


def read_log(path: Path) -> list[Attempt]:
    return parse_log(path.read_text().splitlines()) if path.exists() else []


# --------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class JobOutcome:
    """A trace job as replayed: when it was submitted and its attempts."""

    job: TraceJob
    submitted_t: float
    attempts: list[Attempt]

    @property
    def done(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].done

    @property
    def finished_t(self) -> float | None:
        return self.attempts[-1].last_t if self.done else None


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 = equal, 1/n = one takes all."""
    if not values:
        return float("nan")
    if any(v < 0 for v in values):
        raise ValueError(f"Jain's index needs non-negative shares, got {list(values)}")
    sq = sum(v * v for v in values)
    if sq == 0:
        return float("nan")
    return sum(values) ** 2 / (len(values) * sq)


Interval = tuple[float, float, float]
"""(start, end, weight): e.g. nodes busy, or 1 for a waiting job."""


class HoldLike(Protocol):
    """A node held by a job (``benchmarks.schedulingholds.Hold``)."""

    @property
    def index(self) -> int: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float | None: ...


def waiting_intervals(
    outcomes: Sequence[JobOutcome], end_t: float, *, sized: bool = False
) -> list[Interval]:
    """When each job waited: submit -> its first attempt, and the end of each attempt that
    did not finish it -> the next (requeued); a job never started waits until ``end_t``.
    Weight 1, or with ``sized`` the nodes the job needs."""
    out: list[Interval] = []
    for o in outcomes:
        w = float(o.job.nodes) if sized else 1.0
        since = o.submitted_t
        for a in o.attempts:
            if a.started_t > since:
                out.append((since, a.started_t, w))
            since = a.last_t
        if not o.done and since < end_t:
            out.append((since, end_t, w))
    return out


def busy_intervals(outcomes: Sequence[JobOutcome], team: str | None = None) -> list[Interval]:
    """Nodes held by running attempts (rank 0's process start -> its last line)."""
    return [
        (a.started_t, a.last_t, float(len(a.nodes) or o.job.nodes))
        for o in outcomes
        if team is None or o.job.team == team
        for a in o.attempts
        if a.last_t > a.started_t
    ]


def held_intervals(holds: Sequence[HoldLike], end_t: float) -> list[Interval]:
    """Nodes held by jobs, one interval per node and hold (one never given back: to
    ``end_t``), from the scheduler's records (``benchmarks/schedulingholds.py``)."""
    return [(h.start, end_t if h.end is None else h.end, 1.0) for h in holds]


def held_waiting_intervals(
    outcomes: Sequence[JobOutcome], holds: Sequence[HoldLike], end_t: float
) -> list[Interval]:
    """:func:`waiting_intervals` with the scheduler's holds for attempts: a job waits from
    its submission to its first hold, and from the end of a hold that did not finish it
    (requeued) to the next."""
    per_job: dict[int, dict[float, float]] = {}
    for h in holds:
        ends = per_job.setdefault(h.index, {})
        ends[h.start] = max(ends.get(h.start, h.start), end_t if h.end is None else h.end)
    out: list[Interval] = []
    for o in outcomes:
        since = o.submitted_t
        for start, end in sorted(per_job.get(o.job.index, {}).items()):
            if start > since:
                out.append((since, start, 1.0))
            since = end
        if not o.done and since < end_t:
            out.append((since, end_t, 1.0))
    return out


def _steps(intervals: Iterable[Interval]) -> list[tuple[float, float]]:
    """(time, change) pairs, sorted: the piecewise-constant sum of the intervals."""
    out = []
    for s, e, w in intervals:
        if e > s:
            out += [(s, w), (e, -w)]
    return sorted(out)


def utilisation_while_waiting(
    busy: Sequence[Interval], waiting: Sequence[Interval], capacity: int
) -> float:
    """Busy node-seconds over capacity node-seconds, counted only while some work waits
    (NaN when nothing ever waited). Busy is capped at ``capacity``."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 node, got {capacity}")
    events = [(t, d, 0) for t, d in _steps(busy)] + [(t, d, 1) for t, d in _steps(waiting)]
    events.sort()
    used = total = 0.0
    level = [0.0, 0.0]
    prev = None
    for t, d, which in events:
        if prev is not None and t > prev and level[1] > 0.5:
            used += min(level[0], capacity) * (t - prev)
            total += capacity * (t - prev)
        level[which] += d
        prev = t
    return used / total if total > 0 else float("nan")


def idle_while_waiting(
    busy: Sequence[Interval], waiting_sized: Sequence[Interval], capacity: int
) -> tuple[float, float]:
    """Idle node-seconds while work waits, over capacity node-seconds then, split in two:
    (a waiting job would fit in the idle nodes: start-up and hand-over gaps, the scheduler's
    own latency; no waiting job fits: the gang waits for more nodes, what backfill is for).
    ``waiting_sized``: one interval per waiting job, weighted by the nodes it needs."""
    events = [(s, 0, w) for s, e, w in busy if e > s] + [(e, 0, -w) for s, e, w in busy if e > s]
    events += [(s, 1, w) for s, e, w in waiting_sized if e > s]
    events += [(e, 2, w) for s, e, w in waiting_sized if e > s]
    events.sort()
    level = 0.0
    sizes: dict[float, int] = {}
    fit = nofit = total = 0.0
    prev: float | None = None
    for t, kind, w in events:
        if prev is not None and t > prev and sizes:
            free = max(0.0, capacity - level)
            total += capacity * (t - prev)
            if min(sizes) <= free + 1e-9:
                fit += free * (t - prev)
            else:
                nofit += free * (t - prev)
        if kind == 0:
            level += w
        elif kind == 1:
            sizes[w] = sizes.get(w, 0) + 1
        else:
            sizes[w] -= 1
            if not sizes[w]:
                del sizes[w]
        prev = t
    if total == 0:
        return float("nan"), float("nan")
    return fit / total, nofit / total


def handover_gaps(outcomes: Sequence[JobOutcome], within_s: float = 10.0) -> list[float]:
    """Per node, one attempt's end -> the next attempt's process start there, for the gaps
    under ``within_s`` (longer ones are the node idle for want of work, not a hand-over)."""
    per_node: dict[str, list[tuple[float, float]]] = {}
    for o in outcomes:
        for a in o.attempts:
            for n in a.nodes:
                per_node.setdefault(n, []).append((a.started_t, a.last_t))
    gaps = []
    for runs in per_node.values():
        runs.sort()
        for (_, end), (start, _) in pairwise(runs):
            if 0 <= start - end < within_s:
                gaps.append(start - end)
    return gaps


def overlap(intervals: Sequence[Interval], windows: Sequence[tuple[float, float]]) -> float:
    """Weighted seconds of ``intervals`` inside ``windows`` (disjoint, sorted)."""
    got = 0.0
    for s, e, w in intervals:
        for ws, we in windows:
            lo, hi = max(s, ws), min(e, we)
            if hi > lo:
                got += w * (hi - lo)
    return got


def all_waiting_windows(per_team: Sequence[Sequence[Interval]]) -> list[tuple[float, float]]:
    """The times when every team has at least one job waiting (disjoint, sorted)."""
    if not per_team:
        return []
    events = sorted((t, d, i) for i, ivs in enumerate(per_team) for t, d in _steps(ivs))
    level = [0.0] * len(per_team)
    windows: list[tuple[float, float]] = []
    start: float | None = None
    for t, d, i in events:
        level[i] += d
        every = all(v > 0.5 for v in level)
        if every and start is None:
            start = t
        elif not every and start is not None:
            if t > start:
                windows.append((start, t))
            start = None
    return windows


@dataclass(frozen=True)
class Preemption:
    """An attempt that ended without finishing its job, and the attempt that followed."""

    job: int
    victim_class: str
    notice_t: float | None
    """When the worker logged the notice (None: it was killed without one it could see)."""
    ended_t: float
    last_step: int
    resumed_step: int
    lost_steps: int
    lost_s: float
    """Seconds from completing the step the next attempt resumed from to this attempt's end:
    the work done again (a step cut off by a kill is counted too, up to the kill)."""
    stall_s: float | None
    """Notice -> checkpoint written (None: no save on a notice)."""
    preemptor: int | None
    notice_to_preemptor_step_s: float | None
    """Notice (or end, without one) -> the preemptor's first step (see :func:`preemptions`)."""


def preemptions(outcomes: Sequence[JobOutcome]) -> list[Preemption]:
    """Every attempt followed by another one of its job (unless it had done its last step),
    with the work it lost and its preemptor: the first job of the victim's class or higher
    to run a step on one of its nodes after the notice. The same class counts: a job that
    lent its reserved nodes to a borrower (ADR 0050) takes them back whatever the classes;
    a lower class never preempts."""
    runs = [(o, a) for o in outcomes for a in o.attempts if a.first_step_t is not None or a.nodes]
    out = []
    for o in outcomes:
        for a, nxt in zip(o.attempts, o.attempts[1:], strict=False):
            if a.done:  # preempted after its last step: see reruns_after_done
                continue
            last = a.steps[-1][0] if a.steps else a.resumed_step
            resumed = nxt.resumed_step
            done_at = a.step_t(resumed)
            if done_at is None:  # resumed from before this attempt's first step
                done_at = a.started_t
            lost_steps = max(0, last - resumed)
            told = a.notice_t if a.notice_t is not None else a.last_t
            rank = CLASS_RANK[o.job.priority_class]
            best: tuple[float, int] | None = None
            for other, b in runs:
                first = b.first_step_t
                if (
                    other.job.index == o.job.index
                    or CLASS_RANK[other.job.priority_class] < rank
                    or b.started_t < told - 0.5
                    or first is None
                    or not set(b.nodes) & set(a.nodes)
                ):
                    continue
                if best is None or first < best[0]:
                    best = (first, other.job.index)
            out.append(
                Preemption(
                    job=o.job.index,
                    victim_class=o.job.priority_class,
                    notice_t=a.notice_t,
                    ended_t=a.last_t,
                    last_step=last,
                    resumed_step=resumed,
                    lost_steps=lost_steps,
                    lost_s=max(0.0, a.last_t - done_at),
                    stall_s=(
                        None if a.notice_t is None or a.saved_t is None else a.saved_t - a.notice_t
                    ),
                    preemptor=None if best is None else best[1],
                    notice_to_preemptor_step_s=None if best is None else best[0] - told,
                )
            )
    return out


def reruns_after_done(outcomes: Sequence[JobOutcome]) -> int:
    """Attempts that ran after their job had already done its last step (Slurm preempts and
    requeues a job that ends in the same second, then runs it again for nothing)."""
    return sum(a.done for o in outcomes for a in o.attempts[:-1])


def stats(values: Sequence[float]) -> dict[str, float]:
    """n, mean, p50, p95, max of ``values`` (NaN when empty)."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        nan = float("nan")
        return {"n": 0, "mean": nan, "p50": nan, "p95": nan, "max": nan}
    return {
        "n": len(vals),
        "mean": sum(vals) / len(vals),
        "p50": percentile(vals, 50),
        "p95": percentile(vals, 95),
        "max": max(vals),
    }


TOLERANCE_S = 0.01
"""Slack on "work lost <= stall + grace": the worker sees a notice at its next step boundary
and the log has the time of each line, so a save at once loses the stall plus microseconds."""


def within_target(p: Preemption, grace_s: float) -> bool:
    """Work lost <= one checkpoint stall (this save on the notice, if any) + the grace."""
    return p.lost_s <= (p.stall_s or 0.0) + grace_s + TOLERANCE_S


def replay_metrics(
    outcomes: Sequence[JobOutcome],
    params: TraceParams,
    end_t: float,
    grace_s: float = 0.0,
    holds: Sequence[HoldLike] | None = None,
) -> dict[str, object]:
    """Every figure of one replay, from its outcomes (identical for both sides); ``grace_s``:
    the side's grace period, for the work-lost target; ``holds``: when the scheduler gave
    each node to each job and took it back (None: not recorded; the held figure is NaN)."""
    waiting = waiting_intervals(outcomes, end_t)
    busy = busy_intervals(outcomes)
    held = (
        float("nan")
        if holds is None
        else utilisation_while_waiting(
            held_intervals(holds, end_t),
            held_waiting_intervals(outcomes, holds, end_t),
            params.nodes,
        )
    )
    idle = idle_while_waiting(busy, waiting_intervals(outcomes, end_t, sized=True), params.nodes)
    t0 = min(o.submitted_t for o in outcomes)
    finished = [o.finished_t for o in outcomes if o.finished_t is not None]
    waits: dict[str, list[float]] = {c: [] for c, _ in params.class_mix}
    for o in outcomes:
        if o.attempts:
            waits[o.job.priority_class].append(o.attempts[0].started_t - o.submitted_t)
    per_team_wait = [
        waiting_intervals([o for o in outcomes if o.job.team == team], end_t)
        for team in params.teams
    ]
    windows = all_waiting_windows(per_team_wait)
    shares = {team: overlap(busy_intervals(outcomes, team), windows) for team in params.teams}
    pre = preemptions(outcomes)
    noticed = [p for p in pre if p.notice_t is not None]
    return {
        "jobs": len(outcomes),
        "completed": sum(o.done for o in outcomes),
        "makespan_s": (max(finished) - t0) if finished else float("nan"),
        "utilisation_while_waiting": utilisation_while_waiting(busy, waiting, params.nodes),
        "utilisation_held_while_waiting": held,
        "idle_while_waiting_job_fits": idle[0],
        "idle_while_waiting_none_fits": idle[1],
        "handover_s": stats(handover_gaps(outcomes)),
        "wait_s": {c: stats(v) for c, v in waits.items()},
        "contention_s": sum(e - s for s, e in windows),
        "team_node_s_in_contention": shares,
        "jain_team_shares": jain(list(shares.values())) if windows else float("nan"),
        "preemptions": len(pre),
        "preemptions_with_notice": len(noticed),
        "reruns_after_done": reruns_after_done(outcomes),
        "preemptions_within_target": sum(within_target(p, grace_s) for p in pre),
        "lost_s": stats([p.lost_s for p in pre]),
        "stall_s": stats([p.stall_s for p in pre if p.stall_s is not None]),
        "lost_steps": stats([float(p.lost_steps) for p in pre]),
        "notice_to_preemptor_step_s": stats(
            [p.notice_to_preemptor_step_s for p in pre if p.notice_to_preemptor_step_s is not None]
        ),
        "preemption_list": [asdict(p) for p in pre],
    }
