"""Scheduling benchmark: one job trace replayed on trainpod's embedded scheduler and on a real
Slurm, side by side in one run.

    .venv/bin/python benchmarks/scheduling.py [--runs 5] [--quick]
        [--sides trainpod,trainpod-strict,slurm,slurm-grace]
        [--json benchmarks/results/scheduling.json]

The trace (``benchmarks/schedulingkit.py``, parameters at its top, from a seed): 200 jobs of
1-6 nodes, a few seconds each, priority class high/normal/low, from three teams (one user
each), arriving over 3 minutes on 6 nodes of 1 device: ~1.2x the capacity is offered while
they arrive, so work waits. Every job is a real process per node
(``benchmarks/workers/trace_job.py``): steps of 0.25 s, a checkpoint every 8 steps (2 s), on
the preemption notice a save at once, resumed from its saved step when run again, every
event logged with its time. Every figure is computed from those logs by the same code for
every side.

Sides (each replay on a fresh cluster; the order rotates from run to run):

* ``trainpod``: a local trainpod cluster (6 nodes, 1 device each) whose spec declares the
  three teams (weight 1, lending and borrowing; quota ``--team-quota``, by default the whole
  cluster, see below), their users, the
  priority classes high (1000, not preemptible) / normal (100, default) / low (10) and
  ``preemption: {signal: SIGUSR1, grace_s: 5}``. Each job is submitted over HTTP by its
  team's user with their own token (``priority_class``, ``--time``), so its owner and team
  are the caller's. The trace starts once every node is idle and its agent's zygote has
  done its imports (as on a cluster already up; Slurm's side starts once its nodes are idle).
* ``trainpod-strict``: the same with ``preemption.lend_reserved: false``: no job starts on
  nodes a waiting job reserved unless its ``--time`` ends before that job's start (Slurm's
  rule; trainpod's before ADR 0050).
* ``slurm``: a private Slurm 22.05 (``benchmarks/schedulingslurm.py``: slurm-ci's settings
  plus preemption, 6 nodes of 1 CPU), ``priority/multifactor``, ``sched/backfill`` with the
  same ``--time``, ``preempt/partition_prio`` with ``PreemptMode=REQUEUE``: one partition per
  class (PriorityTier high 3 > normal 2 > low 1, high not preemptible). ``GraceTime=0``:
  Slurm's default notice, SIGTERM then SIGKILL after ``KillWait`` (2 s, slurm-ci's; Slurm's
  own default is 30 s). The batch script ``srun``s the worker on every node.
* ``slurm-grace``: the same with ``GraceTime=5`` (trainpod's kind of notice: a signal, a
  grace, then the kill). A Slurm job that exits by itself during its grace ends COMPLETED,
  not requeued (measured), so here the worker waits for the kill after saving.

What is equivalent and what is not: the class order (trainpod's priority class = Slurm's
partition tier), preemption of lower classes with requeue, backfill with ``--time``, age
order within a class (Slurm 22.05 ignores ``PriorityWeightAge`` without slurmdbd and falls
back to submit order, which is the same thing here). Not equivalent: trainpod's team quotas
with borrowing/reclaim and its fair share by decayed usage have no Slurm counterpart here
(they need slurmdbd: QOS ``GrpTRES`` limits and ``PriorityWeightFairshare``), so by default
each team's trainpod quota is the whole cluster (quotas never bind; fair share still orders
teams within a class). ``--team-quota 2`` (6 nodes / 3 teams) makes quotas bind (the
README says what that gave). Slurm holds a requeued job back for cred_expire+1 = 6 s (its
minimum); Slurm's ``--time`` has minute resolution (every job here declares under a minute,
so Slurm's backfill sees 1 minute each, trainpod's the seconds).

Figures per replay: node utilisation while work waits (busy node-seconds over capacity,
only while some job waits, from the workers' process start to their last line; and again
with a node busy while the scheduler's own records say a job holds it,
``benchmarks/schedulingholds.py``), its idle
rest split by whether a waiting job would have fit the idle nodes, and the node hand-over
(an attempt's end -> the next attempt's start on that node, gaps under 10 s); mean and
p95 wait (submit -> first attempt's process start) per class; Jain's index of the teams'
node-seconds during the times when every team had work waiting; per preemption, the work
lost (seconds from completing the step the next attempt resumed from to the attempt's end)
and the notice -> the preemptor's first step (the higher-class job that started next on the
victim's nodes). Reported as the median [min-max] over the runs, with the load average of
the machine during each side's replays. Targets (the issue): utilisation >= 95% while work
waits; work lost per preemption <= one checkpoint stall plus the grace period.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.benchkit import copy_logs  # noqa: E402
from benchmarks.schedulingholds import holds_of  # noqa: E402
from benchmarks.schedulingkit import (  # noqa: E402
    PARAMS,
    QUICK,
    JobOutcome,
    TraceJob,
    TraceParams,
    make_trace,
    offered_load,
    read_log,
    replay_metrics,
)
from benchmarks.schedulingslurm import SlurmCluster, private_slurm  # noqa: E402

WORKER = REPO / "benchmarks" / "workers" / "trace_job.py"
GRACE_S = 5
SIDES = ("trainpod", "trainpod-strict", "slurm", "slurm-grace")
TRAINPOD_SIDES = {"trainpod": True, "trainpod-strict": False}  # side -> lend_reserved


@dataclass
class Replay:
    side: str
    outcomes: list[JobOutcome]
    submitted: dict[int, float]
    started_t: float
    end_t: float
    load: list[float]
    problems: list[str]

    def save(self, path: Path, wall_s: float) -> None:
        """What the logs do not hold (``--reanalyse`` recomputes every figure from it)."""
        record = {"side": self.side, "submitted": self.submitted, "started_t": self.started_t,
                  "end_t": self.end_t, "load": self.load, "problems": self.problems,
                  "wall_s": wall_s}  # fmt: skip
        path.write_text(json.dumps(record) + "\n")


def load_replay(work: Path, trace: Sequence[TraceJob]) -> tuple[Replay, float]:
    r = json.loads((work / "replay.json").read_text())
    submitted = {int(k): float(v) for k, v in r["submitted"].items()}
    outcomes = outcomes_of(trace, submitted, work / "jobs")
    rep = Replay(r["side"], outcomes, submitted, r["started_t"], r["end_t"], r["load"],
                 r["problems"])  # fmt: skip
    return rep, float(r["wall_s"])


class LoadMeter:
    """The 1-minute load average, sampled every second while a replay runs."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadMeter:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def pace(trace: Sequence[TraceJob], submit: Callable[[TraceJob], None]) -> dict[int, float]:
    """Submit each job at its arrival time; returns when each was submitted."""
    t0 = time.time() + 0.5
    when: dict[int, float] = {}
    for job in trace:
        delay = t0 + job.arrival_s - time.time()
        if delay > 0:
            time.sleep(delay)
        when[job.index] = time.time()
        submit(job)
    return when


def worker_argv(job: TraceJob, jobs_dir: Path, params: TraceParams, mode: str) -> list[str]:
    return [
        sys.executable, str(WORKER), "--dir", str(jobs_dir / str(job.index)),
        "--steps", str(job.steps), "--step-s", str(params.step_s),
        "--ckpt-every", str(params.ckpt_every), "--mode", mode,
    ]  # fmt: skip


def outcomes_of(
    trace: Sequence[TraceJob], submitted: dict[int, float], jobs_dir: Path
) -> list[JobOutcome]:
    return [
        JobOutcome(j, submitted[j.index], read_log(jobs_dir / str(j.index) / "progress.log"))
        for j in trace
        if j.index in submitted
    ]


def deadline_s(params: TraceParams) -> float:
    return params.arrival_s * 3 + 180


def side_grace(side: str) -> int:
    """Seconds between a side's notice and its kill (Slurm's default: none)."""
    return 0 if side == "slurm" else GRACE_S


# --------------------------------------------------------------------------- Slurm


def sbatch(cluster: SlurmCluster, job: TraceJob, argv: list[str], out: Path) -> str:
    script = "#!/bin/bash\nexec srun --ntasks-per-node=1 " + " ".join(argv) + "\n"
    res = subprocess.run(
        [
            "sbatch", "--parsable", "-p", job.priority_class, "-N", str(job.nodes),
            "--ntasks-per-node=1", "--requeue", f"--time={job.time_limit}",
            f"--account={job.team}", f"--comment=user={job.user}", "-J", f"trace{job.index}",
            f"--output={out}", "--open-mode=append",
        ],
        input=script, text=True, env=cluster.env(), capture_output=True, timeout=60,
    )  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"sbatch of trace job {job.index} failed: {res.stderr.strip()}")
    return res.stdout.strip().split(";")[0]


def replay_slurm(side: str, trace: Sequence[TraceJob], params: TraceParams, work: Path) -> Replay:
    grace = side_grace(side)
    jobs_dir, outs = work / "jobs", work / "out"
    outs.mkdir(parents=True)
    ids: dict[int, str] = {}
    problems: list[str] = []
    with private_slurm(work / "slurm", params.nodes, grace) as cluster, LoadMeter() as load:
        started = time.time()

        def submit(job: TraceJob) -> None:
            argv = worker_argv(job, jobs_dir, params, "slurm")
            if grace:
                argv += ["--after-notice", "wait"]
            ids[job.index] = sbatch(cluster, job, argv, outs / f"{job.index}.out")

        submitted = pace(trace, submit)
        ours = set(ids.values())
        deadline = time.monotonic() + deadline_s(params)
        while True:
            listed = cluster.run("squeue", "-h", "-o", "%i", timeout_s=30).split()
            left = ours & set(listed)
            if not left:
                break
            if time.monotonic() > deadline:
                problems.append(f"{len(left)} Slurm jobs still queued or running at the deadline")
                break
            time.sleep(0.5)
        end = time.time()
        shutil.copyfile(cluster.dir / "log" / "slurmctld.log", work / "slurmctld.log")
    return Replay(side, outcomes_of(trace, submitted, jobs_dir), submitted, started, end,
                  load.samples, problems)  # fmt: skip


# --------------------------------------------------------------------------- trainpod

SPEC = """\
name: {name}
backend: local
instance_groups:
  - name: workers
    count: {nodes}
    devices_per_node: 1
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 10
recovery:
  teardown_grace_s: 2
preemption:
  signal: SIGUSR1
  grace_s: {grace}
  min_run_s: 0  # as Slurm's PreemptExemptTime default, so both sides compare like for like
  lend_reserved: {lend}
priority_classes:
  - {{name: high, value: 1000, preemptible: false}}
  - {{name: normal, value: 100, default: true}}
  - {{name: low, value: 10}}
teams:
{teams}
users:
{users}
fair_share:
  half_life_s: 300
"""


def trainpod_spec(name: str, params: TraceParams, quota: int, lend: bool = True) -> str:
    teams = "\n".join(
        f"  - {{name: {t}, quota: {{default: {quota}}}, weight: 1, lend: true, borrow: true}}"
        for t in params.teams
    )
    users = "\n".join(f"  - {{name: {t}-user, team: {t}}}" for t in params.teams)
    return SPEC.format(
        name=name,
        nodes=params.nodes,
        grace=GRACE_S,
        teams=teams,
        users=users,
        lend="true" if lend else "false",
    )


def zygote_warmed(node_dir: Path) -> bool:
    """The agent's zygote on that node has done its later imports (its log says so)."""
    log = node_dir / "zygote.log"
    return log.exists() and ": warmed " in log.read_text(errors="replace")


def replay_trainpod(
    trace: Sequence[TraceJob], params: TraceParams, work: Path, quota: int, side: str = "trainpod"
) -> Replay:
    from trainpod.api.models import NewToken
    from trainpod.backends.local import LocalBackend
    from trainpod.cli.jobs import default_env
    from trainpod.client.http import TrainpodClient
    from trainpod.paths import ClusterPaths, read_secret
    from trainpod.spec.job import JobSpec
    from trainpod.spec.loading import load_cluster_spec
    from trainpod.testing.wait import wait_until

    name = "bench-sched"
    spec_path = work / f"{name}.yaml"
    spec_path.write_text(trainpod_spec(name, params, quota, TRAINPOD_SIDES[side]))
    paths = ClusterPaths.of(name)
    backend = LocalBackend(paths)
    jobs_dir = work / "jobs"
    problems: list[str] = []
    record = backend.create(load_cluster_spec(spec_path), spec_path)
    admin = TrainpodClient(record.url, read_secret(paths.admin_token))
    users: dict[str, TrainpodClient] = {}
    try:
        wait_until(
            lambda: all(n.state == "idle" for n in admin.nodes()),
            timeout_s=120,
            what="the trainpod nodes idle",
        )
        # A shared cluster runs for days: the trace starts once every agent's zygote has
        # done its imports (torch, then dynamo and DCP: 6-12 s here, six at once on 2
        # cores), as it would on a cluster already up; before, the first jobs' starts waited
        # for those imports or started cold, by chance of the box's speed that day.
        wait_until(
            lambda: all(
                zygote_warmed(paths.node_dir(n.name)) for n in admin.nodes() if n.role != "head"
            ),
            timeout_s=300,
            what="every agent's zygote warmed",
        )
        for team in params.teams:
            issued = admin.add_user(NewToken(name=f"{team}-user", team=team))
            users[team] = TrainpodClient(record.url, issued.token)
        ids: dict[int, int] = {}
        env = default_env()
        with LoadMeter() as load:
            started = time.time()

            def submit(job: TraceJob) -> None:
                spec = JobSpec(
                    command=worker_argv(job, jobs_dir, params, "trainpod"),
                    name=f"trace{job.index}",
                    nodes=job.nodes,
                    procs_per_node=1,
                    priority_class=job.priority_class,
                    time_limit=job.time_limit,
                    env=env,
                    workdir=str(work),
                )
                ids[job.index] = users[job.team].submit(spec).id

            submitted = pace(trace, submit)
            ours = set(ids.values())
            deadline = time.monotonic() + deadline_s(params)
            while True:
                live = {j.id for j in admin.jobs(include_ended=False)} & ours
                if not live:
                    break
                if time.monotonic() > deadline:
                    problems.append(f"{len(live)} trainpod jobs not ended at the deadline")
                    break
                time.sleep(0.5)
            end = time.time()
        for j in admin.jobs(include_ended=True):
            if j.id in ours and j.state != "completed":
                problems.append(f"trainpod job {j.id} ended {j.state.value}: {j.reason}")
    finally:
        for c in users.values():
            c.close()
        admin.close()
        copy_logs(paths, work / "logs")
        if paths.db.exists():  # the events, for timing each hop of a hand-over
            with sqlite3.connect(paths.db) as src, sqlite3.connect(work / "controller.db") as dst:
                src.backup(dst)
        if paths.record.exists():
            backend.delete(purge=True)
    return Replay(side, outcomes_of(trace, submitted, jobs_dir), submitted, started,
                  end, load.samples, problems)  # fmt: skip


# --------------------------------------------------------------------------- report


def median_range(values: Sequence[float]) -> dict[str, float]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        nan = float("nan")
        return {"median": nan, "min": nan, "max": nan, "runs": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "runs": len(vals)}  # fmt: skip


def num(value: object) -> float:
    if not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def figures(m: dict[str, object], params: TraceParams) -> dict[str, float]:
    """The flat figures of one replay's metrics (what the table and the medians show)."""
    out: dict[str, float] = {}
    out["utilisation while work waits (%)"] = 100 * num(m["utilisation_while_waiting"])
    out["  the same, nodes held by the scheduler (%)"] = 100 * num(
        m.get("utilisation_held_while_waiting", float("nan"))
    )
    out["  idle then, a waiting job fit (%)"] = 100 * num(m["idle_while_waiting_job_fits"])
    out["  idle then, no waiting job fit (%)"] = 100 * num(m["idle_while_waiting_none_fits"])
    hand = m["handover_s"]
    assert isinstance(hand, dict)
    out["node hand-over (end -> next start): p50 (s)"] = hand["p50"]
    out["node hand-over (end -> next start): p95 (s)"] = hand["p95"]
    waits = m["wait_s"]
    assert isinstance(waits, dict)
    for cls, _ in params.class_mix:
        out[f"wait {cls}: mean (s)"] = waits[cls]["mean"]
        out[f"wait {cls}: p95 (s)"] = waits[cls]["p95"]
    out["Jain's index of team shares (contention)"] = num(m["jain_team_shares"])
    out["preemptions"] = num(m["preemptions"])
    out["preemptions that saw the notice"] = num(m["preemptions_with_notice"])
    out["reruns of a job that had already finished"] = num(m["reruns_after_done"])
    for key, label in (
        ("lost_s", "work lost per preemption"),
        ("stall_s", "checkpoint stall on the notice"),
        ("notice_to_preemptor_step_s", "notice -> preemptor's first step"),
    ):
        s = m[key]
        assert isinstance(s, dict)
        out[f"{label}: mean (s)"] = s["mean"]
        out[f"{label}: p95 (s)"] = s["p95"]
        out[f"{label}: max (s)"] = s["max"]
    out["makespan (s)"] = num(m["makespan_s"])
    out["jobs completed"] = num(m["completed"])
    return out


def fmt(v: dict[str, float]) -> str:
    """median [min-max]; 3 decimals below 1 (milliseconds of lost work show)."""
    if v["runs"] == 0:
        return "-"
    d = 3 if abs(v["median"]) < 1 else 2 if abs(v["median"]) < 100 else 1
    if v["runs"] == 1 or v["min"] == v["max"]:
        return f"{v['median']:.{d}f}"
    return f"{v['median']:.{d}f} [{v['min']:.{d}f}-{v['max']:.{d}f}]"


def table(summary: dict[str, dict[str, dict[str, float]]], sides: Sequence[str]) -> str:
    labels = list(next(iter(summary.values())).keys()) if summary else []
    rows = [["figure", *sides]] + [[lab] + [fmt(summary[s][lab]) for s in sides] for lab in labels]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, help="replays per side (default 5; --quick: 1)")
    ap.add_argument("--quick", action="store_true", help="40 jobs over 40 s, 1 run: a smoke run")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "scheduling.json"))
    ap.add_argument(
        "--team-quota",
        type=int,
        help="trainpod: each team's quota in nodes (default: the whole cluster, so quotas "
        "never bind, as on this Slurm, which has none without slurmdbd; 2 = nodes/teams "
        "makes them bind: see the README)",
    )
    ap.add_argument("--keep", help="keep every replay's logs under this directory")
    ap.add_argument(
        "--reanalyse",
        metavar="DIR",
        help="replay nothing: recompute every figure from the replays kept in DIR (--keep)",
    )
    args = ap.parse_args()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    bad = [s for s in sides if s not in SIDES]
    if bad or not sides:
        ap.error(f"--sides: unknown {bad}; use a comma list of {', '.join(SIDES)}")
    params = QUICK if args.quick else PARAMS
    runs = args.runs or (1 if args.quick else 5)
    trace = make_trace(params)
    keep = args.reanalyse or args.keep
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="bsched-", dir="/tmp"))
    os.environ["TRAINPOD_HOME"] = str(root / "home")
    print(f"trace: {len(trace)} jobs over {params.arrival_s:.0f} s on {params.nodes} nodes, "
          f"offered load {offered_load(trace, params):.2f}; {runs} run(s) of {', '.join(sides)}; "
          f"logs in {root}", flush=True)  # fmt: skip
    per_side: dict[str, list[dict[str, object]]] = {s: [] for s in sides}
    raw: list[dict[str, object]] = []
    load_medians: dict[str, list[float]] = {s: [] for s in sides}
    failed = False

    def measure(rep: Replay, run: int, wall_s: float, work: Path) -> None:
        nonlocal failed
        side = rep.side
        m = replay_metrics(rep.outcomes, params, rep.end_t, side_grace(side), holds_of(work))
        m["load_1min"] = {"min": min(rep.load, default=math.nan),
                          "median": statistics.median(rep.load) if rep.load else math.nan,
                          "max": max(rep.load, default=math.nan)}  # fmt: skip
        load_medians[side].append(statistics.median(rep.load) if rep.load else math.nan)
        m["problems"] = rep.problems
        m["replay_wall_s"] = wall_s
        per_side[side].append(m)
        raw.append({"run": run, "side": side, **m})
        f = figures(m, params)
        failed |= bool(rep.problems)
        print(f"run {run} {side}: {m['completed']}/{m['jobs']} completed, "
              f"utilisation {f['utilisation while work waits (%)']:.1f}%, "
              f"{m['preemptions']} preemptions, load {m['load_1min']}, "
              f"{wall_s:.0f} s" + (f"; PROBLEMS {rep.problems}" if rep.problems
                                   else ""), flush=True)  # fmt: skip

    if args.reanalyse:
        for work in sorted(root.glob("run*-*")):
            if (work / "replay.json").exists() and work.name.split("-", 1)[1] in sides:
                rep, wall = load_replay(work, trace)
                measure(rep, int(work.name[3:].split("-")[0]), wall, work)
        runs = max((len(v) for v in per_side.values()), default=0)
    for run in range(0 if args.reanalyse else runs):
        order = sides[run % len(sides) :] + sides[: run % len(sides)]
        for side in order:
            work = root / f"run{run + 1}-{side}"
            work.mkdir(parents=True)
            t0 = time.monotonic()
            if side in TRAINPOD_SIDES:
                quota = args.team_quota or params.nodes
                rep = replay_trainpod(trace, params, work, quota, side)
            else:
                rep = replay_slurm(side, trace, params, work)
            wall = time.monotonic() - t0
            rep.save(work / "replay.json", wall)
            measure(rep, run + 1, wall, work)
    summary = {
        side: {
            label: median_range([figures(m, params)[label] for m in ms])
            for label in figures(ms[0], params)
        }
        for side, ms in per_side.items()
        if ms
    }
    loads = {side: median_range(v) for side, v in load_medians.items()}
    print()
    print(table(summary, sides))
    print("load average (1 min, median of the replays' medians): "
          + ", ".join(f"{s} {fmt(v)}" for s, v in loads.items()))  # fmt: skip
    targets = {}
    for side in sides:
        ms = per_side[side]
        util = summary[side]["utilisation while work waits (%)"]["median"]
        pre = sum(int(num(m["preemptions"])) for m in ms)
        ok = sum(int(num(m["preemptions_within_target"])) for m in ms)
        grace = side_grace(side)
        targets[side] = {
            "utilisation >= 95% while work waits": util >= 95,
            "preemptions losing <= one checkpoint stall + grace": f"{ok}/{pre}",
            "grace_s": grace,
        }
        print(
            f"targets {side}: utilisation {util:.1f}% (median) >= 95%: "
            f"{'met' if util >= 95 else 'NOT met'}; work lost <= checkpoint stall + grace "
            f"({grace} s): {ok} of {pre} preemptions"
            + ("" if pre == 0 else (": met" if ok == pre else ": NOT met"))
        )
    out = {
        "command": " ".join(["benchmarks/scheduling.py", *sys.argv[1:]]),
        "logs": str(root),
        "params": {k: v for k, v in vars(params).items()},
        "offered_load": offered_load(trace, params),
        "grace_s": GRACE_S,
        "team_quota": args.team_quota or params.nodes,
        "runs": runs,
        "summary": summary,
        "load_1min": loads,
        "targets": targets,
        "replays": raw,
    }
    if not args.quick or args.json != ap.get_default("json"):
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
