"""Where a node's hand-over goes on trainpod: every hop between one job's end on a node and
the next job's start there, from one kept replay (``benchmarks/scheduling.py --keep DIR``).

    .venv/bin/python benchmarks/scheduling_handover.py DIR/run1-trainpod [--json OUT]

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
from benchmarks.schedulingkit import Attempt, read_log  # noqa: E402

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
    ap.add_argument("run_dirs", nargs="+", help="kept trainpod replays (DIR/runN-trainpod)")
    ap.add_argument("--within", type=float, default=10.0, help="longest gap counted (s)")
    ap.add_argument("--json", help="write the hand-overs and the summary here")
    args = ap.parse_args()
    hs = [h for d in args.run_dirs for h in handovers(Path(d), args.within)]
    s = summary(hs)
    print(f"{len(hs)} hand-overs from {len(args.run_dirs)} replay(s); milliseconds:")
    print(f"{'hop':16} {'p50':>8} {'p95':>8} {'mean':>8}")
    for k, v in s.items():
        if v["n"]:
            print(f"{k:16} {v['p50'] * 1e3:8.1f} {v['p95'] * 1e3:8.1f} {v['mean'] * 1e3:8.1f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"summary": s, "handovers": [asdict(h) for h in hs]}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
