"""What the dashboard's pages show, built from the API's models: pure functions, no I/O.

The routes (:mod:`trainpod.dashboard.routes`) read the controller and pass the results here;
the templates only lay them out. Chart data comes out as the ``{type, data, options}``
objects Chart.js takes, so the page's script only hands them to the library.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainpod.api.models import EventInfo, JobInfo
from trainpod.controller.config import ControllerConfig
from trainpod.controller.history import ProgressPoint
from trainpod.model.events import details, parse
from trainpod.model.states import AttemptState, JobState
from trainpod.telemetry.goodput import BUCKETS, GoodputReport

WAITING = (JobState.QUEUED, JobState.PREEMPTED)
_PALETTE = (
    "#2e7d32",  # productive first (BUCKETS' order puts queued first: given below)
    "#1565c0",
    "#6a1b9a",
    "#ef6c00",
    "#c62828",
    "#00838f",
    "#ad1457",
    "#4e342e",
    "#9e9d24",
    "#5d4037",
    "#37474f",
    "#827717",
    "#283593",
    "#757575",
)
BUCKET_COLOURS = {b: _PALETTE[i % len(_PALETTE)] for i, b in enumerate(BUCKETS)}
BUCKET_COLOURS["productive"] = "#2e7d32"
BUCKET_COLOURS["queued"] = "#90a4ae"


def waiting_in_order(jobs: Iterable[JobInfo]) -> list[JobInfo]:
    """Waiting jobs in scheduling order (the scheduler's last pass), unranked ones last."""
    waiting = [j for j in jobs if j.state in WAITING]
    return sorted(waiting, key=lambda j: (j.queue_position is None, j.queue_position or 0, j.id))


def holding(jobs: Iterable[JobInfo]) -> list[JobInfo]:
    """Jobs past the queue and not ended: starting, running, recovering, stopping."""
    return [j for j in jobs if j.state not in WAITING and not j.state.ended]


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def clock(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts is not None else "-"


def span(start: float | None, end: float | None, now: float) -> str:
    if start is None:
        return "-"
    d = max(0.0, (end or now) - start)
    if d < 120:
        return f"{d:.0f}s"
    if d < 7200:
        return f"{d / 60:.1f}m"
    return f"{d / 3600:.1f}h"


def size(n: int | float | None) -> str:
    """Bytes for people: 7.7 KiB, 1.2 GiB."""
    if not n:
        return "-"
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:.0f} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


# -- teams --------------------------------------------------------------------------------
@dataclass
class TeamRow:
    name: str
    weight: float
    lend: bool
    borrow: bool
    borrow_limit: int | None
    quota: dict[str, int]
    used: dict[str, int] = field(default_factory=dict)
    running: int = 0
    waiting: int = 0

    def borrowed(self, partition: str) -> int:
        return max(0, self.used.get(partition, 0) - self.quota.get(partition, 0))

    @property
    def partitions(self) -> list[str]:
        return sorted(set(self.quota) | set(self.used))


def teams(cfg: ControllerConfig, jobs: Iterable[JobInfo]) -> list[TeamRow]:
    """Each team's quota per partition, the nodes its jobs hold now, and what it borrows
    (held beyond its quota). Jobs of no declared team are shown under ``-``."""
    rows = {
        t.name: TeamRow(
            name=t.name,
            weight=t.weight,
            lend=t.lend,
            borrow=t.borrow,
            borrow_limit=t.borrow_limit,
            quota=dict(cfg.team_quotas.get(t.name, {})),
        )
        for t in cfg.teams
    }
    for j in jobs:
        if j.state.ended:
            continue
        team = j.spec.team or "-"
        row = rows.get(team)
        if row is None:
            row = rows[team] = TeamRow(team, 1.0, False, False, None, {})
        if j.state in WAITING:
            row.waiting += 1
            continue
        live = next((a for a in reversed(j.attempts) if not a.state.ended), None)
        if live is None:
            continue
        part = j.spec.partition or cfg.default_partition
        row.used[part] = row.used.get(part, 0) + len(live.nodes)
        row.running += 1
    return list(rows.values())


# -- a job's page -------------------------------------------------------------------------
@dataclass(frozen=True)
class TierRow:
    tier: str
    last_step: int | None
    commits: int
    last_bytes: int
    last_at: float | None
    failures: int
    last_failure: str


def checkpoint_tiers(events: Sequence[EventInfo], uploads: Iterable[Any] = ()) -> list[TierRow]:
    """Per tier: the newest step committed (saved, for the memory tier), how many commits,
    and failures with the last one's reason."""
    acc: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.kind not in ("checkpoint_saved", "checkpoint_committed", "checkpoint_failed"):
            continue
        tier = str(e.data.get("tier", "?"))
        a = acc.setdefault(tier, {"step": None, "n": 0, "bytes": 0, "at": None, "f": 0, "why": ""})
        step = e.data.get("step")
        if e.kind == "checkpoint_failed":
            a["f"] += 1
            a["why"] = f"step {step} on {e.node}: {e.data.get('reason', '')}"
            continue
        a["n"] += 1
        if isinstance(step, int) and (a["step"] is None or step >= a["step"]):
            a["step"], a["bytes"], a["at"] = step, int(e.data.get("bytes") or 0), e.ts
    order = {"memory": 0, "scratch": 1, "peer": 2, "durable": 3}
    return [
        TierRow(t, a["step"], a["n"], a["bytes"], a["at"], a["f"], a["why"])
        for t, a in sorted(acc.items(), key=lambda kv: (order.get(kv[0], 9), kv[0]))
    ]


def timeline(events: Sequence[EventInfo], limit: int = 200) -> list[dict[str, Any]]:
    """The job's newest ``limit`` events, newest first, with their typed fields."""
    out = []
    for e in list(events)[-limit:][::-1]:
        shown = details(parse(e))
        shown.pop("log_tail", None)
        out.append(
            {
                "id": e.id,
                "at": clock(e.ts) + f".{int(e.ts * 1000) % 1000:03d}",
                "kind": e.kind,
                "node": e.node or "",
                "attempt": e.attempt or "",
                "data": " ".join(f"{k}={_value(v)}" for k, v in shown.items()),
            }
        )
    return out


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".")
    if isinstance(v, tuple | list):
        return ",".join(str(x) for x in v)
    if isinstance(v, dict):
        return ",".join(f"{k}->{x}" for k, x in v.items())
    return str(v)


def goodput_chart(report: GoodputReport) -> dict[str, Any]:
    """Where the job's wall clock went, as a Chart.js doughnut (seconds per bucket)."""
    buckets = [(b, report.buckets.get(b, 0.0)) for b in BUCKETS]
    shown = [(b, round(s, 2)) for b, s in buckets if s > 0.005]
    return {
        "type": "doughnut",
        "data": {
            "labels": [b for b, _ in shown],
            "datasets": [
                {
                    "label": "seconds",
                    "data": [s for _, s in shown],
                    "backgroundColor": [BUCKET_COLOURS[b] for b, _ in shown],
                }
            ],
        },
        "options": {"plugins": {"legend": {"position": "right"}}},
    }


def progress_charts(points: Sequence[ProgressPoint]) -> dict[str, dict[str, Any]]:
    """Loss by step and step rate by time, one line per attempt (a restart starts a new
    line, so recomputed steps show as an overlap): Chart.js line charts on linear axes."""
    attempts = sorted({p.attempt for p in points})
    t0 = points[0].t if points else 0.0
    loss, rate = [], []
    for i, number in enumerate(attempts):
        mine = [p for p in points if p.attempt == number]
        colour = _PALETTE[i % len(_PALETTE)]
        style = {"borderColor": colour, "backgroundColor": colour, "pointRadius": 0}
        loss.append(
            {
                "label": f"attempt {number}",
                "data": [{"x": p.step, "y": p.loss} for p in mine if p.loss is not None],
                **style,
            }
        )
        rate.append(
            {
                "label": f"attempt {number}",
                "data": [
                    {"x": round(p.t - t0, 2), "y": round(1.0 / p.step_time_s, 3)}
                    for p in mine
                    if p.step_time_s
                ],
                **style,
            }
        )

    def line(datasets: list[dict[str, Any]], x: str, y: str) -> dict[str, Any]:
        return {
            "type": "line",
            "data": {"datasets": datasets},
            "options": {
                "parsing": True,
                "scales": {
                    "x": {"type": "linear", "title": {"display": True, "text": x}},
                    "y": {"title": {"display": True, "text": y}},
                },
            },
        }

    return {
        "loss": line(loss, "step", "loss"),
        "rate": line(rate, "seconds since the first point", "steps / s"),
    }


def has_loss(points: Sequence[ProgressPoint]) -> bool:
    return any(p.loss is not None for p in points)


@dataclass(frozen=True)
class ClusterGoodput:
    jobs: int
    wall_s: float
    productive_s: float
    lost_by_cause: dict[str, float]

    @property
    def ratio(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None


def cluster_goodput(reports: Iterable[GoodputReport]) -> ClusterGoodput:
    """Goodput over several jobs: their productive seconds over their wall clock (queueing
    excluded: a job waits for capacity, it does not waste it)."""
    n, wall, productive = 0, 0.0, 0.0
    lost: dict[str, float] = {}
    for r in reports:
        n += 1
        wall += r.wall_s - r.buckets.get("queued", 0.0)
        productive += r.buckets.get("productive", 0.0)
        for cause, s in r.lost_by_cause.items():
            lost[cause] = lost.get(cause, 0.0) + s
    return ClusterGoodput(n, wall, productive, lost)


def restarts(job: JobInfo) -> int:
    return sum(1 for a in job.attempts if a.state is AttemptState.FAILED)
