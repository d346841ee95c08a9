"""Where a node's hand-over goes on trainpod: every hop between one job's end on a node and
the next job's start there, from one kept replay (``benchmarks/scheduling.py --keep DIR``).

    .venv/bin/python benchmarks/scheduling_handover.py DIR/run1-trainpod ... [--json OUT]

Per hand-over (node N, job A's attempt ends, job B's attempt is the next to run there, B's
placement came less than ``--within`` seconds after A's end), the times, all on this
machine's one clock:

1. A's last log line (``benchmarks/workers/trace_job.py``; only rank 0 logs, so on a gang's
   other nodes this is rank 0's, and the first hop may be negative there) ->
2. the agent saw A's rank exit (``rank_exited.exited_at``: the watcher's ``wait()`` returned)
   -> (*process exit*: the interpreter's shutdown)
3. the controller recorded that exit (the ``rank_exited`` event's time) -> (*report*: the
   agent's immediate beat)
4. B's attempt was created with N (``attempt_created``) -> (*placement*: the scheduler pass)
5. the agent began B's rank (``rank_started.started_at``, just before the fork or ``Popen``)
   -> (*order delivery*: the long poll's answer)
6. B's first log line (``start``) -> (*process start*: fork or interpreter start, imports)

Then where the idle capacity goes while work waits (node-seconds over capacity, the same
windows as the benchmark's utilisation): a node *held but not running* (placed, its job's
rank 0 not between its first and last line: launch, start-up, exit, a gang's last rank),
*free briefly* (under 0.5 s between release and the next placement: the scheduler's own
hand-over) and *free longer* (no waiting job was given it: a gang waiting for more nodes, a
reservation that backfill may not use, the classes' order).

Pure reading of the kept files: the worker logs, ``controller.db`` (the event log, copied
at the end of the replay) and the trace's job names (``trace<index>``).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.benchkit import percentile  # noqa: E402
from benchmarks.scheduling import load_replay  # noqa: E402
from benchmarks.schedulingholds import holds_of  # noqa: E402
from benchmarks.schedulingkit import PARAMS, Attempt, make_trace, read_log  # noqa: E402
from benchmarks.schedulingkit import waiting_intervals as waits_of  # noqa: E402

HOPS = ("process exit", "report", "placement", "order delivery", "process start")


@dataclass(frozen=True)
class Handover:
    node: str
    from_job: int
    to_job: int
    last_line_t: float
    exited_t: float
    recorded_t: float
    placed_t: float
    spawned_t: float
    start_line_t: float

    def hops(self) -> dict[str, float]:
        t = (self.last_line_t, self.exited_t, self.recorded_t, self.placed_t, self.spawned_t,
             self.start_line_t)  # fmt: skip
        return {h: t[i + 1] - t[i] for i, h in enumerate(HOPS)}

    @property
    def total_s(self) -> float:
        return self.start_line_t - self.last_line_t


def _attempt_of(attempts: list[Attempt], node: str, started_after: float) -> Attempt | None:
    """The worker attempt (rank 0's log) that ran on ``node`` and started first after."""
    after = [a for a in attempts if node in a.nodes and a.started_t >= started_after]
    return min(after, key=lambda a: a.started_t, default=None)


def handovers(run_dir: Path, within_s: float = 10.0) -> list[Handover]:
    db = sqlite3.connect(run_dir / "controller.db")
    names = {jid: name for jid, name in db.execute("SELECT id, name FROM jobs")}
    index = {jid: int(n[5:]) for jid, n in names.items() if n.startswith("trace")}
    logs = {jid: read_log(run_dir / "jobs" / str(i) / "progress.log") for jid, i in index.items()}
    rows = db.execute("SELECT ts, kind, node, job_id, attempt, data FROM events ORDER BY id")
    exits: dict[tuple[int, int, str], tuple[float, float]] = {}  # (job, attempt, node)
    created: list[tuple[float, int, int, tuple[str, ...]]] = []
    spawned: dict[tuple[int, int, str], float] = {}
    for ts, kind, node, job, attempt, raw in rows:
        data = json.loads(raw)
        if kind == "rank_exited" and node and data.get("exited_at"):
            key = (job, attempt, node)
            exits[key] = max(exits.get(key, (0.0, 0.0)), (float(data["exited_at"]), ts))
        elif kind == "attempt_created":
            created.append((ts, job, attempt, tuple(data.get("nodes", ()))))
        elif kind == "rank_started" and node and data.get("started_at"):
            key = (job, attempt, node)
            spawned[key] = min(spawned.get(key, float("inf")), float(data["started_at"]))
    out = []
    for (job, _attempt, node), (exited_t, recorded_t) in exits.items():
        nxt = [c for c in created if node in c[3] and c[0] >= recorded_t and c[1] != job]
        if not nxt or job not in logs:
            continue
        placed_t, to_job, to_attempt, _ = min(nxt)
        if placed_t - recorded_t > within_s or to_job not in logs:
            continue
        spawn = spawned.get((to_job, to_attempt, node))
        # Only rank 0 logs: on another node, its rank's end is that attempt's nearest end.
        ended = [a for a in logs[job] if node in a.nodes]
        if spawn is None or not ended:
            continue
        last = min(ended, key=lambda a: abs(a.last_t - exited_t))
        started = _attempt_of(logs[to_job], node, spawn - 1e-3)
        if started is None:
            continue
        out.append(Handover(node, job, to_job, last.last_t, exited_t, recorded_t, placed_t,
                            spawn, started.started_t))  # fmt: skip
    return sorted(out, key=lambda h: h.last_line_t)


Span = tuple[float, float]


def _union(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _minus(spans: list[Span], cut: list[Span]) -> list[Span]:
    """``spans`` less ``cut`` (both disjoint and sorted)."""
    out: list[Span] = []
    for a, b in spans:
        cur = a
        for x, y in cut:
            if y <= cur or x >= b:
                continue
            if x > cur:
                out.append((cur, x))
            cur = max(cur, y)
        if cur < b:
            out.append((cur, b))
    return out


def _inside(spans: list[Span], windows: list[Span]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for a, b in spans for x, y in windows)


def idle_breakdown(run_dir: Path, brief_s: float = 0.5) -> dict[str, float]:
    """Idle capacity while work waits, by where it went (fractions of the capacity then)."""
    rep, _ = load_replay(run_dir, make_trace(PARAMS))
    windows = _union([(s, e) for s, e, _ in waits_of(rep.outcomes, rep.end_t)])
    capacity = PARAMS.nodes * sum(b - a for a, b in windows)
    holds = holds_of(run_dir)
    if holds is None:
        raise SystemExit(f"{run_dir}: neither controller.db nor slurmctld.log to read holds from")
    nodes = sorted({h.node for h in holds})
    running: dict[str, list[Span]] = {n: [] for n in nodes}
    for o in rep.outcomes:
        for a in o.attempts:
            for n in a.nodes:
                running.setdefault(n, []).append((a.started_t, a.last_t))
    out = {"held, not running": 0.0, "free briefly": 0.0, "free longer": 0.0}
    for n in nodes:
        held = _union([(h.start, rep.end_t if h.end is None else h.end) for h in holds
                       if h.node == n])  # fmt: skip
        out["held, not running"] += _inside(_minus(held, _union(running[n])), windows)
        for a, b in _minus([(rep.started_t, rep.end_t)], held):
            out["free briefly" if b - a < brief_s else "free longer"] += _inside([(a, b)], windows)
    return {k: v / capacity for k, v in out.items()} if capacity else out


def summary(hs: list[Handover]) -> dict[str, dict[str, float]]:
    cols = {h: [x.hops()[h] for x in hs] for h in HOPS}
    cols["total"] = [x.total_s for x in hs]
    return {
        k: {"n": len(v), "p50": percentile(v, 50), "p95": percentile(v, 95),
            "mean": sum(v) / len(v)} if v else {"n": 0}
        for k, v in cols.items()
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "run_dirs", nargs="+", help="kept replays (DIR/runN-SIDE; the hops: trainpod's only)"
    )
    ap.add_argument("--within", type=float, default=10.0, help="longest gap counted (s)")
    ap.add_argument("--json", help="write the hand-overs and the summary here")
    args = ap.parse_args()
    tp = [d for d in args.run_dirs if (Path(d) / "controller.db").exists()]
    hs = [h for d in tp for h in handovers(Path(d), args.within)]
    s = summary(hs)
    print(f"{len(hs)} hand-overs from {len(tp)} trainpod replay(s); milliseconds:")
    print(f"{'hop':16} {'p50':>8} {'p95':>8} {'mean':>8}")
    for k, v in s.items():
        if v["n"]:
            print(f"{k:16} {v['p50'] * 1e3:8.1f} {v['p95'] * 1e3:8.1f} {v['mean'] * 1e3:8.1f}")
    idle = {d: idle_breakdown(Path(d)) for d in args.run_dirs}
    print("idle capacity while work waits (% of the capacity then):")
    for d, parts in idle.items():
        print(f"  {Path(d).name}: " + ", ".join(f"{k} {v * 100:.1f}%" for k, v in parts.items()))
    if args.json:
        out = {"summary": s, "idle_while_waiting": idle, "handovers": [asdict(h) for h in hs]}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
