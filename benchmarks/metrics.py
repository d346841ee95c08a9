"""Metrics benchmark: what observability costs a training step, and a ``/metrics`` scrape.

``--part step`` (benchmarks/metrics_step.py): a training loop's step time with the beacon
path's metrics on (the agent's TensorBoard writer) vs off (the same beacon server, no
writer), median of ``--step-runs`` interleaved runs; target: at most 1%. ``--part scrape``:
the cost of one ``/metrics`` scrape at 1,000 nodes and 10,000 jobs, below. ``--part all``
(the default) runs both, the step first.

A real :class:`~trainpod.controller.core.Controller` on a real SQLite file, driven in-process
by fake agents (``trainpod.testing.FakeAgent``) on a fake clock: ``--nodes`` nodes (default
1,000) of ``--devices`` SIMULATED devices each (default 8; the agent's real sampler over its
simulated reader, so every heartbeat carries device telemetry), ``--jobs`` one-node jobs
(default 10,000), started ``--batch`` at a time: the first ``jobs - nodes`` run and end
(the history: ended jobs with their events and energy), then one job per node is left
running with progress beacons (loss, tokens).

It then times the scrape as ``GET /metrics`` serves it (the controller's collector and the
text exposition, ``trainpod.telemetry.exposition.render``) in ``--runs`` runs (default 5),
one after another on the same history. Each run starts two cold collectors side by side:
one on a store where no ended job's goodput is kept yet (a store from before migration 11),
then one as a restarted controller has it (the goodput earlier scrapes kept in the store;
nothing in memory, nothing folded, no spec decoded). It times the first scrapes of each,
which work the history off a bounded piece at a time (the event log folded into the
counters; the ended jobs' goodput not kept yet computed once, and kept), until caught up;
then ``--scrapes`` scrapes (default 7) with ``--beats`` agents (default 50) beating between
them. It reports the median of the runs' medians with their min/max spread, the first
scrape's and the catch-up's, the body's size and its series count, and the 1-minute load
average of each run (the box is shared). Target: every scrape under 1 s, the first ones
included. Building the history takes most of the run (about 15 minutes at the defaults on a
2-core box).

Run it from the repository root, under the shared benchmark lock::

    flock /tmp/bench.lock .venv/bin/python benchmarks/metrics.py [--part all|step|scrape]
        [--step-runs 7] [--steps 300] [--step-ms 10] [--nodes 1000] [--jobs 10000]
        [--devices 8] [--runs 5] [--scrapes 7] [--json benchmarks/results/metrics.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

import metrics_step
from trainpod.agent.devices import DeviceTelemetry, SimulatedReader
from trainpod.controller.core import Controller
from trainpod.controller.metrics import ClusterMetrics
from trainpod.spec.job import JobSpec
from trainpod.store.repo import Store
from trainpod.telemetry.exposition import render
from trainpod.testing import FakeAgent, FakeClock, FakeGroup, make_config

DEFAULT_JSON = Path(__file__).parent / "results" / "metrics.json"
STEP_JSON = Path(__file__).parent / "results" / "metrics-step.json"
TARGET_S = 1.0


def build(
    root: Path, nodes: int, devices: int, jobs: int, batch: int
) -> tuple[Controller, list[FakeAgent]]:
    # The fake clock jumps 2 minutes after the history (so ended jobs' goodput is kept): no
    # node is called lost nor any job hung for it.
    cfg = make_config(
        root,
        groups=[FakeGroup("workers", nodes, devices=devices)],
        heartbeat_timeout_s=1e6,
        hang_timeout_s=1e6,
    )
    clock = FakeClock()
    controller = Controller(Store.open(root / "state.db"), cfg, clock=clock, ports=lambda _: 29500)
    controller.bootstrap()
    agents = [FakeAgent(controller, d.name) for d in cfg.nodes]
    for a in agents:
        a.devices = DeviceTelemetry(SimulatedReader(devices, None, clock.now), clock=clock.now)
        a.beat()
    # A heartbeat's orders cost grows with the attempts running (OrderDesk reads them all),
    # so jobs are started `batch` at a time: the history on the first `batch` nodes, ending
    # each batch; then one live job per node, left running.
    history = max(0, jobs - nodes)
    for done in range(0, history, batch):
        wave(controller, agents[: min(batch, history - done)], devices, end=True)
    for first in range(0, min(nodes, jobs), batch):
        wave(controller, agents[first : min(first + batch, jobs, nodes)], devices, end=False)
        print(f"  {first + batch} live jobs", flush=True)
    clock.advance(120.0)
    return controller, agents


def wave(controller: Controller, agents: list[FakeAgent], devices: int, *, end: bool) -> None:
    """One one-node job per agent, started, stepping (loss, tokens) and, if ``end``, done."""
    clock = controller.clock
    spec = JobSpec(command=["python", "train.py"], nodes=1, procs_per_node=devices)
    for i in range(len(agents)):
        controller.submit(spec.model_copy(update={"team": f"t{i % 4}"}))
    controller.step()
    for a in agents:
        a.start_ranks(a.beat())
    assert isinstance(clock, FakeClock)
    clock.advance(5.0)
    for a in agents:
        for attempt in a.attempts:
            for rank in a.running_ranks(attempt):
                if rank == 0:
                    a.progress(attempt, rank, 10, step_time_s=0.5, loss=2.0, tokens=4096)
                else:
                    a.progress(attempt, rank, 10, step_time_s=0.5)
            if end:
                a.exit_all(attempt)
        a.beat()
    controller.step()


def scrape(registry: CollectorRegistry) -> tuple[float, float, bytes]:
    wall, cpu = time.perf_counter(), time.process_time()
    body = render(registry.collect())
    return time.perf_counter() - wall, time.process_time() - cpu, body


def cold_collector(controller: Controller) -> tuple[ClusterMetrics, CollectorRegistry]:
    """A collector as a restarted controller has it on this store: nothing kept, nothing
    folded, no spec decoded."""
    c = controller
    metrics = ClusterMetrics(
        c.store, c.cfg, c._lock, c.beacons, c.telemetry, c.planner, c.clock.now
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    return metrics, registry


def forget_kept(controller: Controller) -> None:
    """The store as one from before ended jobs' goodput was kept (migration 11)."""
    with controller._lock, controller.store.transaction():
        controller.store.connection.execute("DELETE FROM goodput_ended")


def one_run(
    controller: Controller, agents: list[FakeAgent], args: argparse.Namespace, *, kept: bool
) -> Run:
    """A cold collector (``kept``: on a store where earlier scrapes kept ended jobs'
    goodput, as a restarted controller finds it; else on one where none is kept): its first
    scrapes until the history is worked off, then ``--scrapes`` scrapes with ``--beats``
    agents beating between them."""
    if not kept:
        forget_kept(controller)
    metrics, registry = cold_collector(controller)
    first: list[float] = []
    while True:
        wall, _, body = scrape(registry)
        first.append(wall)
        last = metrics.last
        assert last is not None
        if not (last.tally_behind or last.goodput_behind):
            break
        if len(first) > 1000:
            raise SystemExit("the collector never caught up with the history")
    walls, cpus, sizes = [], [], []
    for _ in range(args.scrapes):
        controller.clock.advance(1.0)  # type: ignore[attr-defined]
        for a in agents[: args.beats]:
            a.beat()
        controller.step()
        wall, cpu, body = scrape(registry)
        walls.append(wall)
        cpus.append(cpu)
        sizes.append(len(body))
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return Run(first, walls, cpus, int(statistics.median(sizes)), series, os.getloadavg()[0])


@dataclass(frozen=True)
class Run:
    first: list[float]  # the cold collector's scrapes until caught up
    walls: list[float]
    cpus: list[float]
    body_bytes: int
    series: int
    load1: float


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="trainpod-metrics-bench-") as tmp:
        t0 = time.perf_counter()
        controller, agents = build(Path(tmp), args.nodes, args.devices, args.jobs, args.batch)
        built_s = time.perf_counter() - t0
        runs, unkept = [], []
        for i in range(args.runs):  # side by side: nothing kept, then kept (a restart)
            unkept.append(u := one_run(controller, agents, args, kept=False))
            runs.append(r := one_run(controller, agents, args, kept=True))
            print(
                f"  run {i + 1}: nothing kept: first scrapes {[round(w, 3) for w in u.first]}; "
                f"kept: first scrapes {[round(w, 3) for w in r.first]}, "
                f"median {statistics.median(r.walls):.3f}s, load1 {r.load1:.2f}",
                flush=True,
            )
        states: dict[str, int] = {}
        for _, state, _, _ in controller.store.job_heads():
            states[state.value] = states.get(state.value, 0) + 1
        controller.store.close()
    medians = [statistics.median(r.walls) for r in runs]
    every_first = [w for r in runs for w in r.first]
    return {
        "nodes": args.nodes,
        "devices_per_node": args.devices,
        "jobs": args.jobs,
        "job_states": states,
        "build_s": round(built_s, 1),
        "runs": args.runs,
        "scrapes_per_run": args.scrapes,
        "scrape_s": spread(medians),
        "scrape_s_every": spread([w for r in runs for w in r.walls]),
        "scrape_cpu_s_median": round(statistics.median([c for r in runs for c in r.cpus]), 3),
        "first_scrape_s": spread([r.first[0] for r in runs]),
        "catch_up_scrapes": max(len(r.first) for r in runs),
        "catch_up_scrape_max_s": round(max(every_first), 3),
        "catch_up_total_s": spread([sum(r.first) for r in runs]),
        "nothing_kept": {
            "first_scrape_s": spread([u.first[0] for u in unkept]),
            "catch_up_scrapes": max(len(u.first) for u in unkept),
            "catch_up_scrape_max_s": round(max(w for u in unkept for w in u.first), 3),
            "catch_up_total_s": spread([sum(u.first) for u in unkept]),
            "scrape_s": spread([statistics.median(u.walls) for u in unkept]),
        },
        "body_bytes": runs[-1].body_bytes,
        "series": runs[-1].series,
        "target_s": TARGET_S,
        "met": max(medians) < TARGET_S and max(every_first) < TARGET_S,
        "load1": spread([r.load1 for r in runs]),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--part",
        choices=("all", "step", "scrape"),
        default="all",
        help="the training step's cost (metrics on vs off), the scrape's, or both",
    )
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=5, help="cold collectors, one after another")
    ap.add_argument("--scrapes", type=int, default=7, help="scrapes a run times once caught up")
    ap.add_argument("--batch", type=int, default=50, help="jobs started at a time")
    ap.add_argument("--beats", type=int, default=50, help="agents that beat between scrapes")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--step-runs", type=int, default=7, help="runs per mode of the step part")
    ap.add_argument("--steps", type=int, default=300, help="steps per run of the step part")
    ap.add_argument("--step-ms", type=float, default=10.0, help="a step's work, in ms")
    ap.add_argument("--step-json", type=Path, default=STEP_JSON)
    args = ap.parse_args(argv)
    if args.runs < 5 or args.step_runs < 5:
        ap.error("--runs and --step-runs must be at least 5 (the median of fewer says little)")
    if args.scrapes < 1 or args.steps < 10 or args.step_ms <= 0:
        ap.error("--scrapes must be at least 1, --steps at least 10, --step-ms above 0")
    if args.part in ("all", "step"):
        step = metrics_step.measure(args.steps, args.step_runs, args.step_ms)
        args.step_json.parent.mkdir(parents=True, exist_ok=True)
        args.step_json.write_text(json.dumps(step, indent=2) + "\n")
        print(metrics_step.summary(step), flush=True)
    if args.part in ("all", "scrape"):
        result = run(args)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(scrape_summary(result))
    return 0


def scrape_summary(result: dict[str, Any]) -> str:
    s, f, load = result["scrape_s"], result["first_scrape_s"], result["load1"]
    u = result["nothing_kept"]
    return (
        f"scrape at {result['nodes']} nodes x {result['devices_per_node']} devices, "
        f"{result['jobs']} jobs {result['job_states']}, {result['runs']} runs of "
        f"{result['scrapes_per_run']} scrapes: median {s['median']:.3f}s "
        f"[{s['min']:.3f}-{s['max']:.3f}], {result['body_bytes'] / 1e6:.2f} MB, "
        f"{result['series']} series; first scrape of a restarted controller (goodput kept) "
        f"{f['median']:.3f}s [{f['min']:.3f}-{f['max']:.3f}], caught up in "
        f"{result['catch_up_scrapes']} scrapes, the longest "
        f"{result['catch_up_scrape_max_s']:.3f}s; nothing kept: first scrape "
        f"{u['first_scrape_s']['median']:.3f}s, history worked off in "
        f"{u['catch_up_scrapes']} scrapes, the longest {u['catch_up_scrape_max_s']:.3f}s; "
        f"load1 {load['median']} [{load['min']}-{load['max']}]; target < {TARGET_S:g}s: "
        f"{'met' if result['met'] else 'NOT met'}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
