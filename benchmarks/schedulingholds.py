"""When each job held its nodes, from the scheduler's own records, for the scheduling
benchmark's "nodes held" utilisation (``benchmarks/scheduling.py``).

A node is busy from the moment the scheduler gives it to a job until it takes it back,
whatever the job does meanwhile (its processes starting, running, saving, exiting), as
Slurm's ``sreport`` counts allocated time. The figure the workers' logs give (busy from a
rank's first line to its last) leaves out the job's own start-up and exit; this one counts
them as the job's and leaves only the scheduler's hand-over (release -> next allocation)
idle. Both sides are read to the millisecond:

* trainpod: the controller's event log (``controller.db``, kept by the replay):
  ``attempt_created`` (the attempt's nodes are the job's from then) ->
  ``node_released`` (that node given back);
* Slurm: ``slurmctld.log``: ``sched: Allocate JobId=N NodeList=...`` or
  ``sched/backfill: _start_job: Started JobId=N in P on ...`` -> ``_job_complete: JobId=N
  done`` or, for a preempted job, ``Requeuing JobId=N`` (logged once its processes have
  ended, right before the nodes go to the preemptor); a job's trace index from the
  ``Name=trace<i>`` of ``jobcomp.log``.
"""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from trainpod.slurm.hostlist import expand


@dataclass(frozen=True)
class Hold:
    """Trace job ``index`` held ``node`` from ``start`` to ``end`` (None: never given back)."""

    index: int
    node: str
    start: float
    end: float | None


def trainpod_holds(db: Path) -> list[Hold]:
    conn = sqlite3.connect(db)
    try:
        names = dict(conn.execute("SELECT id, name FROM jobs").fetchall())
        rows = conn.execute(
            "SELECT ts, kind, node, job_id, data FROM events ORDER BY id"
        ).fetchall()
    finally:
        conn.close()
    index = {jid: int(n[5:]) for jid, n in names.items() if str(n).startswith("trace")}
    open_: dict[tuple[int, str], float] = {}
    out: list[Hold] = []
    for ts, kind, node, job, raw in rows:
        if job not in index:
            continue
        if kind == "attempt_created":
            for n in json.loads(raw).get("nodes", []):
                open_.setdefault((job, n), ts)  # a restart in place keeps its hold
        elif kind == "node_released" and (job, node) in open_:
            out.append(Hold(index[job], node, open_.pop((job, node)), ts))
    out += [Hold(index[j], n, s, None) for (j, n), s in open_.items()]
    return out


_LINE = re.compile(r"^\[(?P<t>[0-9T:.\-]+)\] (?P<msg>.*)$")
_START = (
    re.compile(r"^sched: Allocate JobId=(?P<job>\d+) NodeList=(?P<nodes>\S+)"),
    re.compile(r"^sched/backfill: _start_job: Started JobId=(?P<job>\d+) in \S+ on (?P<nodes>\S+)"),
)
_END = (
    re.compile(r"^_job_complete: JobId=(?P<job>\d+) done"),
    re.compile(r"^Requeuing JobId=(?P<job>\d+)$"),
)
_NAME = re.compile(r"\bJobId=(?P<job>\d+) .*\bName=trace(?P<index>\d+)\b")


def slurm_holds(slurmctld_log: Path, jobcomp_log: Path) -> list[Hold]:
    """The holds of slurmctld's log (local-time stamps, as this machine's clock reads)."""
    index: dict[int, int] = {}
    for line in jobcomp_log.read_text().splitlines():
        m = _NAME.search(line)
        if m:
            index[int(m["job"])] = int(m["index"])
    open_: dict[int, tuple[float, list[str]]] = {}
    out: list[Hold] = []
    for line in slurmctld_log.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        t, msg = datetime.fromisoformat(m["t"]).timestamp(), m["msg"]
        for pat in _START:
            s = pat.match(msg)
            if s and int(s["job"]) in index:
                open_[int(s["job"])] = (t, expand(s["nodes"]))
        for pat in _END:
            e = pat.match(msg)
            if e and int(e["job"]) in open_:
                job = int(e["job"])
                start, nodes = open_.pop(job)
                out += [Hold(index[job], n, start, t) for n in nodes]
    out += [Hold(index[j], n, s, None) for j, (s, nodes) in open_.items() for n in nodes]
    return out


def holds_of(run_dir: Path) -> list[Hold] | None:
    """The holds of one kept replay, from whichever records it has (None: none)."""
    if (run_dir / "controller.db").exists():
        return trainpod_holds(run_dir / "controller.db")
    ctld, comp = run_dir / "slurmctld.log", run_dir / "slurm" / "log" / "jobcomp.log"
    if ctld.exists() and comp.exists():
        return slurm_holds(ctld, comp)
    return None
