"""Control-plane benchmark: one real controller under N simulated agents and a dashboard.

For each N in ``--agents`` (default 100,500,1000) a fresh cluster's controller runs as the
real process (``python -m trainpod.controller.daemon --state-dir DIR``: real SQLite, real
HTTP, uvicorn) with the code under ``--src`` (or ``$TRAINPOD_BENCH_SRC``; default: whatever
trainpod this interpreter imports) first on its ``PYTHONPATH``, which the benchmark checks
and records. No agent process is started: the state dir is written by ``trainpod cluster
create``'s own code (``LocalBackend.create`` with ``start()`` a no-op, run in the
controller's interpreter; see ``controlplanekit.SETUP_SCRIPT``), declaring N one-device
compute nodes of the local backend in groups of at most 64, with ``recovery.auto_repair:
false`` (so that a node declared lost is never "repaired" by spawning a real agent) and the
default health policy (heartbeat every 1 s, node lost after 10 s without one).

The N agents are simulated by one asyncio process (``controlplanekit``'s swarm, speaking the
wire protocol only: ``POST /v1/agent/heartbeat`` with a real agent's payload: node facts and
five health results, about 2 KB). Like ``trainpod.agent.agent.Agent``, each has

* a beat loop: back-to-back long polls with ``wait_s`` = the orders'
  ``heartbeat_interval_s`` (1 s) and the last ``orders_hash`` echoed, so the controller holds
  each beat until the orders change or ``wait_s`` passes; client timeout ``wait_s + 15 s``,
  0.5 s pause after a failure (as ``TrainpodClient``/``Agent``);
* a reporter: a ``wait_s=0`` beat whenever its ranks changed (a launch order starts a
  simulated rank, reported running at once and exited with code 0 50 ms later, so jobs
  complete), and a **probe**: the same ``wait_s=0`` beat every ``--probe-every-s`` (5 s)
  at a random phase. Probes add 20% to the 1 beat/s per agent.

Meanwhile a dashboard (main process) calls ``GET /v1/jobs?all=true`` and ``GET
/v1/events?after=<cursor>&limit=1000`` once a second, and a submitter posts a one-node
``/bin/true`` job (``POST /v1/jobs``) every ``--job-every-s`` (1.5 s); both give up on a call
after 10 s (counted as unanswered).

After registration (all N agents answered once, or ``--register-timeout-s``) and a warm-up,
``--windows`` (5) consecutive windows of ``--window-s`` (8 s) are measured; every figure is
given per window and then as the median over the windows with its spread (min-max). The
swarm stops ``DRAIN_S`` after the last window.

* **heartbeat round trip** = the probes: a ``wait_s=0`` beat is answered without waiting,
  so its round trip is the controller's cost of a heartbeat plus any queueing. p50/p99 over
  the answered probes sent in the window; ``p99_all`` counts every unanswered probe
  (timeout, error, still pending when the swarm stopped) as infinitely slow (``null`` =
  more than 1% unanswered). Also: the long polls' **overshoot** (round trip minus ``wait_s``
  of the polls answered with unchanged orders, i.e. held to their deadline), timeouts and
  errors of every kind of beat, and heartbeats answered per second.
* **orders-to-agent latency**: ``POST /v1/jobs`` sent -> the first reply (a long poll woken
  early, or a report) carrying the job's launch order, at whichever simulated agent the
  scheduler chose; a job whose order never arrived (or whose submit failed) counts as
  infinite. The jobs' final states
  (``GET /v1/jobs/{id}``) tell whether they completed.
* **controller CPU per heartbeat**: user+system CPU of the controller process (psutil, all
  threads) over the window / heartbeats answered in it. It includes everything the
  controller did meanwhile (reconcile loop, dashboard, submits), so it is an upper bound.
* the swarm's own CPU and event-loop lag, and the load average, per window; and the
  **floor**: the largest swarm against a server that answers heartbeats with fixed orders
  and does nothing else (``controlplanekit``'s stub; 3 windows, ``--no-floor`` skips it),
  i.e. what the load generator and the machine's load add to the figures by themselves.
* what happened: registrations, the nodes' final states and every node state change (from
  ``GET /v1/nodes`` and ``GET /v1/events`` once the swarm has stopped), the submitted jobs'
  states (``GET /v1/jobs/{id}`` and ``GET /v1/jobs?all=true``), and how long the controller
  took to answer again. If it does not answer within ``--settle-s`` (20 s), it is stopped
  and these are read from a fresh controller started on the same state dir.

**GET /v1/jobs?all=true at 10,000 jobs** (``--jobs``): another fresh controller whose store
was pre-populated *before it started* with completed one-node ``/bin/true`` jobs (one
succeeded attempt, one exited rank and their events each, written through that trainpod's
own ``trainpod.store.repo.Store``; submitting 10,000 jobs through the API and completing
them takes minutes on this box). The listing is timed ``--list-reps`` (7) times on the idle
controller, then again while ``--jobs-agents`` (100) simulated agents heartbeat, with the
probes' round trip during those listings. ``same_shape_as_an_api_job`` in the JSON says
whether a pre-populated job reads back with the same fields as one that went through
``POST /v1/jobs`` and a simulated agent in the agents phases (both examples are kept).

Targets: heartbeat p99 < 100 ms at 1,000 agents (judged on the probes' ``p99_all``, so an
unanswered probe counts against it); listing 10,000 jobs < 200 ms on the idle controller
(PASS/FAIL is printed, a miss is not an error). In the table ``inf`` marks a figure with
too many unanswered requests (or none answered) to have a value; the counts are beside it.
``--quick`` (a smoke test, not for results): 100 and 500 agents, 3 s windows, 2,000 jobs.
The controller and swarm share the machine's cores with the dashboard and whatever else
runs (2 cores here): the load average is recorded.

Run it from the repository root::

    .venv/bin/python benchmarks/control_plane.py [--agents 100,500,1000] [--jobs 10000] \\
        [--quick] [--src /work/baseline/src] [--out benchmarks/results/control_plane.json]

Everything lives in a temporary directory removed at the end (``--keep DIR`` copies the
controller and swarm logs there first); every process it started is stopped, on errors and
Ctrl-C too. The exit status is 1 when a phase could not run at all, 0 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchkit import json_safe, percentile, raise_interrupt, signals_ignored
from controlplanekit import (
    cpu_s,
    setup_state_dir,
    start_controller,
    start_stub,
    start_swarm,
    stop_process,
    swarm_status,
    trainpod_imported_from,
    wait_ready,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "control_plane.json"
TARGET_HB_P99_S = 0.100
TARGET_HB_AGENTS = 1000
TARGET_LIST_S = 0.200
GROUP_MAX = 64  # nodes per instance group (the spec's limit)
JOB = {"command": ["/bin/true"], "nodes": 1, "name": "bench-cp", "user": "bench", "workdir": "/"}
API_TIMEOUT_S = 10.0  # the dashboard's, the submitter's and the final queries' timeout
LIST_TIMEOUT_S = 60.0  # the jobs phase's listings
DRAIN_S = 2.0
FLOOR_WINDOWS = 3
SWARM_STOP_S = 20.0


# -- statistics -------------------------------------------------------------------------------
def pcts(values: list[float], unanswered: int = 0) -> dict[str, Any]:
    """p50/p99/max of the answered ones; ``p99_all`` counts ``unanswered`` as infinite."""
    out: dict[str, Any] = {
        "n": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values) if values else float("nan"),
        "unanswered": unanswered,
    }
    every = [*values, *([math.inf] * unanswered)]
    p99_all = percentile(every, 99) if every else float("nan")
    out["p99_all"] = None if math.isinf(p99_all) else p99_all
    return out


def spread(values: list[float | None]) -> dict[str, Any]:
    """Median over the windows and its spread. A window without a value (None or NaN: the
    figure was infinite, or nothing was answered to compute it from) sorts above all."""
    if not values:
        return {"median": None, "min": None, "max": None, "windows": []}
    known = sorted(v for v in values if v is not None and math.isfinite(v))
    ordered: list[float | None] = [*known, *([None] * (len(values) - len(known)))]
    return {
        "median": ordered[(len(ordered) - 1) // 2] if len(ordered) % 2 else _mid(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "windows": values,
    }


def _mid(ordered: list[float | None]) -> float | None:
    a, b = ordered[len(ordered) // 2 - 1], ordered[len(ordered) // 2]
    return None if a is None or b is None else (a + b) / 2


def shape(value: Any) -> Any:
    """The keys of a JSON document, recursively (a list by its first item): two jobs have
    the same shape when the API returns the same fields for both."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return "*"


# -- the dashboard and the submitter ------------------------------------------------------------
class ApiCalls(threading.Thread):
    """A client of the public API in a thread of its own: the dashboard (jobs and events
    once a second) or the submitter (a job every ``period_s``). Records every call."""

    def __init__(self, what: str, url: str, token: str, period_s: float) -> None:
        super().__init__(name=what, daemon=True)
        self.what = what
        self.period_s = period_s
        self.stop = threading.Event()
        self.calls: list[dict[str, Any]] = []
        self.cursor = 0
        self._http = httpx.Client(
            base_url=url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=API_TIMEOUT_S,
            trust_env=False,
        )

    def call(self, name: str, method: str, path: str, **kw: Any) -> Any:
        t0 = time.monotonic()
        rec: dict[str, Any] = {"call": name, "t": t0, "ok": False}
        body: Any = None
        try:
            resp = self._http.request(method, path, **kw)  # the whole body is read here
            rec["dur"] = time.monotonic() - t0
            rec["status"] = resp.status_code
            rec["bytes"] = len(resp.content)
            if resp.status_code < 400:
                body = resp.json()
                rec["ok"] = True
        except httpx.TimeoutException:
            rec["error"] = "timeout"
        except httpx.HTTPError as exc:
            rec["error"] = type(exc).__name__
        rec.setdefault("dur", time.monotonic() - t0)
        self.calls.append(rec)
        return body

    def run(self) -> None:
        t_next = time.monotonic()
        while not self.stop.is_set():
            if self.what == "dashboard":
                jobs = self.call("list_jobs", "GET", "/v1/jobs", params={"all": "true"})
                if jobs is not None:
                    self.calls[-1]["items"] = len(jobs)
                params = {"after": self.cursor, "limit": 1000}
                events = self.call("events", "GET", "/v1/events", params=params)
                if events:
                    self.cursor = int(events[-1]["id"])
            else:
                job = self.call("submit", "POST", "/v1/jobs", json=JOB)
                if job is not None:
                    self.calls[-1]["job_id"] = int(job["id"])
            t_next = max(t_next + self.period_s, time.monotonic())
            self.stop.wait(t_next - time.monotonic())
        self._http.close()


def api(info: dict[str, Any], timeout_s: float = API_TIMEOUT_S) -> httpx.Client:
    return httpx.Client(
        base_url=info["url"],
        headers={"Authorization": f"Bearer {info['admin_token']}"},
        timeout=timeout_s,
        trust_env=False,
    )


def spec_yaml(name: str, nodes: int) -> str:
    groups = "".join(
        f"  - name: g{g:02d}\n    count: {min(GROUP_MAX, nodes - g * GROUP_MAX)}\n"
        "    devices_per_node: 1\n"
        for g in range(math.ceil(nodes / GROUP_MAX))
    )
    return (
        f"name: {name}\nbackend: local\ninstance_groups:\n{groups}recovery:\n  auto_repair: false\n"
    )


# -- processes --------------------------------------------------------------------------------
class Phase:
    """One fresh cluster: state dir, controller, optionally a swarm; always torn down."""

    def __init__(self, args: argparse.Namespace, root: Path, name: str, nodes: int) -> None:
        self.args = args
        self.home = root / name
        self.name = name
        self.nodes = nodes
        self.ctrl: subprocess.Popen[bytes] | None = None
        self.swarm: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self.facts: dict[str, Any] = {}

    def start(self, jobs: int = 0) -> None:
        t0 = time.monotonic()
        self.info = setup_state_dir(
            self.args.src, self.home, spec_yaml(f"bench-{self.name}", self.nodes), jobs, JOB
        )
        self.facts["setup_s"] = time.monotonic() - t0
        self.facts["prepopulated_jobs"] = self.info.get("prepopulated_jobs", 0)
        if "prepopulate_s" in self.info:
            self.facts["prepopulate_s"] = self.info["prepopulate_s"]
        self.ctrl = start_controller(self.args.src, self.info, self.home)
        self.facts["controller_ready_s"] = wait_ready(self.ctrl, self.info)
        self.facts["controller_trainpod"] = self.info["trainpod_file"]

    @property
    def status_path(self) -> Path:
        return self.home / "swarm-status.json"

    @property
    def results_path(self) -> Path:
        return self.home / "swarm-results.json"

    def start_swarm(self, nodes: list[str], max_s: float) -> None:
        cfg = {
            "url": self.info["url"],
            "agent_token": self.info["agent_token"],
            "nodes": nodes,
            "probe_every_s": self.args.probe_every_s,
            "start_spread_s": self.args.start_spread_s,
            "status_path": str(self.status_path),
            "results_path": str(self.results_path),
            "max_s": max_s,
        }
        self.swarm = start_swarm(cfg, self.home)

    def wait_registered(self, want: int, timeout_s: float) -> tuple[int, float]:
        t0 = time.monotonic()
        while True:
            got = int(swarm_status(self.status_path).get("registered", 0))
            if got >= want or time.monotonic() - t0 > timeout_s:
                return got, time.monotonic() - t0
            if self.swarm is not None and self.swarm.poll() is not None:
                raise RuntimeError(f"the swarm exited ({self.swarm.returncode}); see swarm.log")
            time.sleep(0.1)

    def stop_swarm(self) -> dict[str, Any]:
        """SIGTERM the swarm and read everything it recorded."""
        if self.swarm is None:
            return {}
        if self.swarm.poll() is None:
            self.swarm.send_signal(signal.SIGTERM)
            try:
                self.swarm.wait(timeout=SWARM_STOP_S)
            except subprocess.TimeoutExpired:
                self.swarm.kill()
                self.swarm.wait(timeout=10)
        self.swarm = None
        try:
            return dict(json.loads(self.results_path.read_text()))
        except (OSError, ValueError):
            return {}

    def restart_controller(self) -> None:
        assert self.ctrl is not None
        self.facts["first_controller_exit"] = stop_process(self.ctrl, 5.0)
        self.ctrl = start_controller(self.args.src, self.info, self.home)
        self.facts["restarted_controller_ready_s"] = wait_ready(self.ctrl, self.info)

    def sample(self) -> dict[str, Any]:
        assert self.ctrl is not None
        s: dict[str, Any] = {
            "t": time.monotonic(),
            "ctrl_cpu_s": cpu_s(self.ctrl.pid),
            "swarm_cpu_s": cpu_s(self.swarm.pid) if self.swarm else float("nan"),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
        }
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(self.ctrl.pid)
            s["ctrl_threads"] = p.num_threads()
            s["ctrl_rss_mib"] = round(p.memory_info().rss / 2**20, 1)
            s["ctrl_connections"] = len(p.net_connections(kind="tcp"))
        return s

    def close(self) -> None:
        with signals_ignored():
            if self.swarm is not None:
                stop_process(self.swarm, SWARM_STOP_S)
                self.swarm = None
            if self.ctrl is not None:
                self.facts["controller_alive_at_end"] = self.ctrl.poll() is None
                self.facts["controller_exit"] = stop_process(self.ctrl, 15.0)
                self.ctrl = None
            if self.args.keep is not None:
                dest = self.args.keep / self.name
                dest.mkdir(parents=True, exist_ok=True)
                for log in [*self.home.glob("*.log"), Path(self.info.get("log", "/nonexistent"))]:
                    if log.is_file():
                        shutil.copyfile(log, dest / log.name)


# -- the agents phase -------------------------------------------------------------------------
def agents_phase(args: argparse.Namespace, root: Path, n: int) -> dict[str, Any]:
    phase = Phase(args, root, f"agents-{n}", n)
    dash: ApiCalls | None = None
    sub: ApiCalls | None = None
    out: dict[str, Any] = {"agents": n}
    try:
        phase.start()
        nodes = list(phase.info["nodes"])
        run_s = args.register_timeout_s + args.warm_s + args.windows * args.window_s + 120
        phase.start_swarm(nodes, max_s=run_s)
        registered, reg_s = phase.wait_registered(n, args.register_timeout_s)
        out["registered"] = registered
        out["registration_s"] = reg_s
        print(f"  {n} agents: {registered} registered in {reg_s:.1f} s", flush=True)
        url, token = phase.info["url"], phase.info["admin_token"]
        dash = ApiCalls("dashboard", url, token, 1.0)
        sub = ApiCalls("submitter", url, token, args.job_every_s)
        dash.start()
        sub.start()
        time.sleep(args.warm_s)
        samples = [phase.sample()]
        for w in range(args.windows):
            time.sleep(max(0.0, samples[0]["t"] + (w + 1) * args.window_s - time.monotonic()))
            samples.append(phase.sample())
            print(f"  window {w + 1}/{args.windows} load {samples[-1]['loadavg'][0]}", flush=True)
        time.sleep(DRAIN_S)
        for c in (dash, sub):
            c.stop.set()
        for c in (dash, sub):
            c.join(API_TIMEOUT_S + 5)
        swarm = phase.stop_swarm()
        out["settle"] = settle(phase.info, args.settle_s)
        out["controller_answers_again_after_s"] = out["settle"]["answered_after_s"]
        out["final_read_from"] = "the same controller"
        if out["controller_answers_again_after_s"] is None:
            # Still working off its backlog: read the outcome from a fresh controller on the
            # same state dir (everything it knows is in SQLite; its start-up resets every
            # node's heartbeat clock, so nothing is declared lost before the reads).
            phase.restart_controller()
            out["final_read_from"] = "a restarted controller on the same state dir"
        out["final"] = final_state(phase.info, [c["job_id"] for c in sub.calls if "job_id" in c])
        out.update(agents_figures(swarm, samples, dash.calls, sub.calls, out["final"]))
        out["samples"] = samples
    finally:
        for c in (dash, sub):
            if c is not None:
                c.stop.set()
        phase.close()
        out["phase"] = phase.facts
    return out


def settle(info: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """After the swarm stopped: how long until ``GET /v1/cluster`` answers within 2 s again
    (an overloaded controller first works off what it queued); None: not in ``timeout_s``.
    Also every try: [start, seconds, outcome]."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"answered_after_s": None, "tries": []}
    with httpx.Client(
        base_url=info["url"],
        headers={"Authorization": f"Bearer {info['admin_token']}"},
        timeout=2.0,
        trust_env=False,
    ) as c:
        while time.monotonic() - t0 < timeout_s:
            t_try = time.monotonic()
            try:
                ok = c.get("/v1/cluster").status_code == 200
                what = "ok" if ok else "refused"
            except httpx.HTTPError as exc:
                ok, what = False, type(exc).__name__
            out["tries"].append([t_try - t0, time.monotonic() - t_try, what])
            if ok:
                out["answered_after_s"] = time.monotonic() - t0
                break
            time.sleep(0.5)
    return out


def final_state(info: dict[str, Any], job_ids: list[int]) -> dict[str, Any]:
    """After the swarm stopped: node states, what the events say happened, the jobs' ends."""
    out: dict[str, Any] = {}
    with api(info) as c:
        try:
            nodes = c.get("/v1/nodes").json()
            out["node_states"] = dict(Counter(str(x["state"]) for x in nodes))
        except (httpx.HTTPError, ValueError) as exc:
            out["node_states_error"] = type(exc).__name__
        kinds: Counter[str] = Counter()
        became: Counter[str] = Counter()
        after = 0
        try:
            while batch := c.get("/v1/events", params={"after": after, "limit": 5000}).json():
                for e in batch:
                    kinds[e["kind"]] += 1
                    if e["kind"] == "node_state":
                        became[str(e["data"].get("new"))] += 1
                after = int(batch[-1]["id"])
        except (httpx.HTTPError, ValueError) as exc:
            out["events_error"] = type(exc).__name__
        out["events_by_kind"] = dict(kinds)
        out["node_state_changes_to"] = dict(became)
        try:
            every = c.get("/v1/jobs", params={"all": "true"}).json()
            out["all_job_states"] = dict(Counter(str(j["state"]) for j in every))
        except (httpx.HTTPError, ValueError) as exc:
            out["all_jobs_error"] = type(exc).__name__
        states: Counter[str] = Counter()
        ends: dict[int, float] = {}
        for job_id in job_ids:
            try:
                job = c.get(f"/v1/jobs/{job_id}").json()
            except (httpx.HTTPError, ValueError):
                states["unreadable"] += 1
                continue
            states[str(job["state"])] += 1
            if job.get("ended_at") is not None:
                ends[job_id] = float(job["ended_at"]) - float(job["submitted_at"])
            if job["state"] == "completed" and "completed_job" not in out:
                out["completed_job"] = job
        out["job_states"] = dict(states)
        out["submitted_to_ended_s"] = pcts(list(ends.values()))
    return out


def agents_figures(
    swarm: dict[str, Any],
    samples: list[dict[str, Any]],
    dash: list[dict[str, Any]],
    subs: list[dict[str, Any]],
    final: dict[str, Any],
) -> dict[str, Any]:
    cols = swarm.get("columns", {})
    beats = list(
        zip(
            cols.get("kind", []),
            cols.get("t_send", []),
            cols.get("t_recv", []),
            cols.get("outcome", []),
            cols.get("held", []),
            cols.get("wait_s", []),
            strict=True,
        )
    )
    launches = {int(k): v for k, v in swarm.get("launches", {}).items()}
    lag = swarm.get("lag", [])
    windows: list[dict[str, Any]] = []
    for s0, s1 in itertools.pairwise(samples):
        a, b = s0["t"], s1["t"]
        sent = [x for x in beats if a <= x[1] < b]
        probes = [x[2] - x[1] for x in sent if x[0] == "probe" and x[3] == "ok"]
        probe_lost = sum(1 for x in sent if x[0] == "probe" and x[3] != "ok")
        over = [x[2] - x[1] - x[5] for x in sent if x[0] == "poll" and x[3] == "ok" and x[4]]
        reports = [x[2] - x[1] for x in sent if x[0] == "report" and x[3] == "ok"]
        served = sum(1 for x in beats if a <= x[2] < b and x[3] == "ok")
        outcomes = Counter(x[3] for x in sent if x[3] != "ok")
        cpu = s1["ctrl_cpu_s"] - s0["ctrl_cpu_s"]
        orders, not_delivered = [], 0
        for c in subs:
            if c["call"] == "submit" and a <= c["t"] < b:
                got = launches.get(c.get("job_id", -1))
                if got is None:
                    not_delivered += 1  # never launched, or the submit itself failed
                else:
                    orders.append(got[0] - c["t"])
        lists = [c for c in dash if c["call"] == "list_jobs" and a <= c["t"] < b]
        events = [c for c in dash if c["call"] == "events" and a <= c["t"] < b]
        lags = [x[1] for x in lag if a <= x[0] < b]
        windows.append(
            {
                "seconds": b - a,
                "loadavg_1m": s1["loadavg"][0],
                "heartbeat_probe_s": pcts(probes, probe_lost),
                "long_poll_overshoot_s": pcts(over),
                "report_beat_s": pcts(reports),
                "long_polls_answered_early": sum(
                    1 for x in sent if x[0] == "poll" and x[3] == "ok" and not x[4]
                ),
                "beats_sent_per_s": len(sent) / (b - a),
                "beats_answered_per_s": served / (b - a),
                "beats_not_ok": dict(outcomes),
                "timeouts": sum(v for k, v in outcomes.items() if k == "timeout"),
                "errors": sum(v for k, v in outcomes.items() if k.startswith("error")),
                "ctrl_cpu_s": cpu,
                "ctrl_cpu_per_heartbeat_ms": cpu / served * 1000 if served else None,
                "ctrl_cpu_fraction_of_a_core": cpu / (b - a),
                "swarm_cpu_fraction_of_a_core": (s1["swarm_cpu_s"] - s0["swarm_cpu_s"]) / (b - a),
                "swarm_loop_lag_s": pcts(lags),
                "orders_to_agent_s": pcts(orders, not_delivered),
                "dashboard_list_jobs_s": pcts(
                    [c["dur"] for c in lists if c["ok"]], sum(1 for c in lists if not c["ok"])
                ),
                "dashboard_events_s": pcts(
                    [c["dur"] for c in events if c["ok"]], sum(1 for c in events if not c["ok"])
                ),
                "ctrl_threads": s1.get("ctrl_threads"),
            }
        )

    def per(key: str, sub: str | None = None) -> dict[str, Any]:
        return spread([w[key][sub] if sub else w[key] for w in windows])

    submits = [c for c in subs if c["call"] == "submit"]
    return {
        "summary": {
            "heartbeat_probe_p50_s": per("heartbeat_probe_s", "p50"),
            "heartbeat_probe_p99_s": per("heartbeat_probe_s", "p99"),
            "heartbeat_probe_p99_all_s": per("heartbeat_probe_s", "p99_all"),
            "heartbeat_probes_unanswered": per("heartbeat_probe_s", "unanswered"),
            "long_poll_overshoot_p50_s": per("long_poll_overshoot_s", "p50"),
            "long_poll_overshoot_p99_s": per("long_poll_overshoot_s", "p99"),
            "report_beat_p50_s": per("report_beat_s", "p50"),
            "beats_answered_per_s": per("beats_answered_per_s"),
            "beats_sent_per_s": per("beats_sent_per_s"),
            "timeouts": per("timeouts"),
            "errors": per("errors"),
            "ctrl_cpu_per_heartbeat_ms": per("ctrl_cpu_per_heartbeat_ms"),
            "ctrl_cpu_fraction_of_a_core": per("ctrl_cpu_fraction_of_a_core"),
            "swarm_cpu_fraction_of_a_core": per("swarm_cpu_fraction_of_a_core"),
            "swarm_loop_lag_p99_s": per("swarm_loop_lag_s", "p99"),
            "orders_to_agent_p50_s": per("orders_to_agent_s", "p50"),
            "dashboard_list_jobs_p50_s": per("dashboard_list_jobs_s", "p50"),
            "dashboard_list_jobs_p99_all_s": per("dashboard_list_jobs_s", "p99_all"),
            "dashboard_events_p50_s": per("dashboard_events_s", "p50"),
            "loadavg_1m": per("loadavg_1m"),
        },
        "pooled": {
            "orders_to_agent_s": pcts(*_orders_pooled(subs, launches, samples)),
            "submit_call_s": pcts([c["dur"] for c in submits if c["ok"]]),
            "submits_failed": sum(1 for c in submits if not c["ok"]),
        },
        "windows": windows,
        "swarm_stats": swarm.get("stats", {}),
        "registered_at_end": len(swarm.get("registered", {})),
        "job_states": final.get("job_states", {}),
    }


def _orders_pooled(
    subs: list[dict[str, Any]], launches: dict[int, list[Any]], samples: list[dict[str, Any]]
) -> tuple[list[float], int]:
    """Every submit in the windows: (submit -> launch order received, the rest: never
    received, or the submit failed)."""
    a, b = samples[0]["t"], samples[-1]["t"]
    jobs = [c for c in subs if c["call"] == "submit" and a <= c["t"] < b]
    got = [launches[c["job_id"]][0] - c["t"] for c in jobs if c.get("job_id") in launches]
    return got, len(jobs) - len(got)


# -- the floor --------------------------------------------------------------------------------
def floor_phase(args: argparse.Namespace, root: Path, n: int) -> dict[str, Any]:
    """The same swarm against a server that does nothing (``controlplanekit``'s stub): what
    the load generator and the machine's load add to every figure by themselves."""
    phase = Phase(args, root, f"floor-{n}", n)
    phase.home.mkdir(parents=True)
    stub, url = start_stub()
    phase.info = {"url": url, "agent_token": "-"}
    out: dict[str, Any] = {"agents": n, "window_count": FLOOR_WINDOWS}
    try:
        nodes = [f"node-{i}" for i in range(n)]
        phase.start_swarm(nodes, max_s=args.register_timeout_s + 120)
        out["registered"], _ = phase.wait_registered(n, args.register_timeout_s)
        time.sleep(args.warm_s)
        t = [time.monotonic()]
        cpu = [(cpu_s(stub.pid), cpu_s(phase.swarm.pid if phase.swarm else 0))]
        load: list[float] = []
        for w in range(FLOOR_WINDOWS):
            time.sleep(max(0.0, t[0] + (w + 1) * args.window_s - time.monotonic()))
            t.append(time.monotonic())
            cpu.append((cpu_s(stub.pid), cpu_s(phase.swarm.pid if phase.swarm else 0)))
            load.append(os.getloadavg()[0])
        time.sleep(DRAIN_S)
        swarm = phase.stop_swarm()
    finally:
        with signals_ignored():
            if phase.swarm is not None:
                stop_process(phase.swarm, SWARM_STOP_S)
            stop_process(stub, 5.0)
    cols = swarm.get("columns", {})
    beats = list(zip(cols["kind"], cols["t_send"], cols["t_recv"], cols["outcome"], cols["held"],
                     cols["wait_s"], strict=True))  # fmt: skip
    windows = []
    for i in range(FLOOR_WINDOWS):
        a, b = t[i], t[i + 1]
        sent = [x for x in beats if a <= x[1] < b]
        probes = [x[2] - x[1] for x in sent if x[0] == "probe" and x[3] == "ok"]
        lost = sum(1 for x in sent if x[0] == "probe" and x[3] != "ok")
        over = [x[2] - x[1] - x[5] for x in sent if x[0] == "poll" and x[3] == "ok" and x[4]]
        windows.append(
            {
                "heartbeat_probe_s": pcts(probes, lost),
                "long_poll_overshoot_s": pcts(over),
                "beats_answered_per_s": sum(1 for x in beats if a <= x[2] < b and x[3] == "ok")
                / (b - a),
                "swarm_loop_lag_s": pcts([x[1] for x in swarm.get("lag", []) if a <= x[0] < b]),
                "stub_cpu_fraction_of_a_core": (cpu[i + 1][0] - cpu[i][0]) / (b - a),
                "swarm_cpu_fraction_of_a_core": (cpu[i + 1][1] - cpu[i][1]) / (b - a),
                "loadavg_1m": load[i],
            }
        )

    def per(key: str, sub: str | None = None) -> dict[str, Any]:
        return spread([w[key][sub] if sub else w[key] for w in windows])

    out["summary"] = {
        "heartbeat_probe_p50_s": per("heartbeat_probe_s", "p50"),
        "heartbeat_probe_p99_s": per("heartbeat_probe_s", "p99"),
        "heartbeat_probe_p99_all_s": per("heartbeat_probe_s", "p99_all"),
        "long_poll_overshoot_p99_s": per("long_poll_overshoot_s", "p99"),
        "beats_answered_per_s": per("beats_answered_per_s"),
        "swarm_loop_lag_p99_s": per("swarm_loop_lag_s", "p99"),
        "swarm_cpu_fraction_of_a_core": per("swarm_cpu_fraction_of_a_core"),
    }
    out["windows"] = windows
    out["swarm_stats"] = swarm.get("stats", {})
    return out


# -- the jobs phase ---------------------------------------------------------------------------
def jobs_phase(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    nodes = max(args.jobs_agents, 1)
    phase = Phase(args, root, "jobs", nodes)
    out: dict[str, Any] = {"jobs": args.jobs, "nodes": nodes}
    try:
        phase.start(jobs=args.jobs)
        print(
            f"  {args.jobs} jobs pre-populated in {phase.facts.get('prepopulate_s', 0):.1f} s",
            flush=True,
        )
        with api(phase.info, LIST_TIMEOUT_S) as c:
            first, last = c.get("/v1/jobs/1").json(), c.get(f"/v1/jobs/{args.jobs}").json()
            out["completed_job"] = first
            out["sample_job"] = {
                "state": [first["state"], last["state"]],
                "attempts": [len(first["attempts"]), len(last["attempts"])],
                "ranks": [len(first["attempts"][0]["ranks"]), len(last["attempts"][0]["ranks"])],
            }
            out["idle"] = list_jobs(c, args.list_reps, 0.5)
            print(
                f"  idle: list {args.jobs} jobs p50 {out['idle']['p50'] * 1000:.0f} ms", flush=True
            )
            if args.jobs_agents:
                phase.start_swarm(list(phase.info["nodes"]), max_s=args.register_timeout_s + 300)
                got, reg_s = phase.wait_registered(args.jobs_agents, args.register_timeout_s)
                out["loaded_registered"] = got
                time.sleep(args.warm_s)
                t0 = time.monotonic()
                out["loaded"] = list_jobs(c, args.list_reps, 1.0)
                t1 = time.monotonic()
                swarm = phase.stop_swarm()
                cols = swarm.get("columns", {})
                during = [
                    (r - s, o)
                    for k, s, r, o in zip(
                        cols.get("kind", []),
                        cols.get("t_send", []),
                        cols.get("t_recv", []),
                        cols.get("outcome", []),
                        strict=True,
                    )
                    if k == "probe" and t0 <= s < t1
                ]
                out["loaded_heartbeat_probe_s"] = pcts(
                    [d for d, o in during if o == "ok"], sum(1 for _, o in during if o != "ok")
                )
                out["loaded_agents"] = args.jobs_agents
                print(
                    f"  with {args.jobs_agents} agents ({got} registered in {reg_s:.1f} s): "
                    f"list p50 {out['loaded']['p50'] * 1000:.0f} ms",
                    flush=True,
                )
    finally:
        phase.close()
        out["phase"] = phase.facts
    return out


def list_jobs(c: httpx.Client, reps: int, gap_s: float) -> dict[str, Any]:
    durs: list[float] = []
    failed = 0
    sizes: list[int] = []
    counts: list[int] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        try:
            resp = c.get("/v1/jobs", params={"all": "true"})  # the whole body is read here
            durs.append(time.perf_counter() - t0)
            body = resp.json()
            sizes.append(len(resp.content))
            counts.append(len(body))
        except (httpx.HTTPError, ValueError):
            failed += 1
        time.sleep(gap_s)
    out = pcts(durs, failed)
    out["samples"] = durs
    out["median"] = statistics.median(durs) if durs else None
    out["min"] = min(durs) if durs else None
    out["bytes"] = sizes[0] if sizes else None
    out["jobs_listed"] = counts[0] if counts else None
    return out


# -- report -----------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "inf"
    return f"{v * 1000:.1f}" if v < 10 else f"{v:.0f}s"


def _t(v: float | None) -> str:
    """A duration with its unit; inf for a figure with unanswered requests above it."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "inf"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def _med(s: dict[str, Any], key: str, scale: str = "ms") -> str:
    f = s[key]
    if scale == "ms":
        return f"{_ms(f['median'])} [{_ms(f['min'])}-{_ms(f['max'])}]"
    if f["median"] is None:
        return "-"
    return f"{f['median']:.{scale}f} [{f['min']:.{scale}f}-{f['max']:.{scale}f}]"


def render(result: dict[str, Any]) -> str:
    lines = [
        f"control plane ({result.get('controller', {}).get('trainpod')}), median [min-max] of "
        f"{result['config']['windows']} windows of {result['config']['window_s']:g} s:",
    ]
    rows = [
        ("registered / agents", None),
        ("heartbeat probe p50 ms", ("heartbeat_probe_p50_s", "ms")),
        ("heartbeat probe p99 ms", ("heartbeat_probe_p99_s", "ms")),
        ("  p99, unanswered = inf", ("heartbeat_probe_p99_all_s", "ms")),
        ("  probes unanswered", ("heartbeat_probes_unanswered", "0")),
        ("long-poll overshoot p50 ms", ("long_poll_overshoot_p50_s", "ms")),
        ("long-poll overshoot p99 ms", ("long_poll_overshoot_p99_s", "ms")),
        ("beats answered /s", ("beats_answered_per_s", "0")),
        ("beats timed out / window", ("timeouts", "0")),
        ("beats failed / window", ("errors", "0")),
        ("orders -> agent p50 ms", ("orders_to_agent_p50_s", "ms")),
        ("controller CPU ms / beat", ("ctrl_cpu_per_heartbeat_ms", "2")),
        ("controller CPU, cores", ("ctrl_cpu_fraction_of_a_core", "2")),
        ("swarm CPU, cores", ("swarm_cpu_fraction_of_a_core", "2")),
        ("dashboard GET /v1/jobs p50 ms", ("dashboard_list_jobs_p50_s", "ms")),
        ("load average (1 min)", ("loadavg_1m", "1")),
    ]
    runs = [r for r in result["agents"] if "summary" in r]
    for label, spec in rows:
        cells = []
        for r in runs:
            if spec is None:
                cells.append(f"{r['registered']}/{r['agents']} ({r['registered_at_end']} by end)")
            else:
                cells.append(_med(r["summary"], spec[0], spec[1]))
        lines.append(f"  {label:<31}" + "".join(f"{c:>28}" for c in cells))
    lines.insert(1, f"  {'agents':<31}" + "".join(f"{r['agents']:>28}" for r in runs))
    for r in runs:
        pooled = r["pooled"]["orders_to_agent_s"]
        lines.append(
            f"  {r['agents']} agents: orders->agent pooled p50 {_t(pooled['p50'])}, "
            f"p99 {_t(pooled['p99_all'])} ({pooled['n']} delivered, "
            f"{pooled['unanswered']} not, {r['pooled']['submits_failed']} submits failed); "
            f"jobs {r['final'].get('all_job_states')}"
        )
        lines.append(
            f"    nodes at end {r['final'].get('node_states')}; the controller answered again "
            f"{_t(r['controller_answers_again_after_s'])} after the swarm stopped (final "
            f"states from {r['final_read_from']})"
        )
    floor = result.get("floor") or {}
    if "summary" in floor:
        f = floor["summary"]
        lines.append(
            f"  floor ({floor['agents']} agents, a do-nothing server, {floor['window_count']} "
            "windows): "
            f"probe p50 {_med(f, 'heartbeat_probe_p50_s')} ms, p99 "
            f"{_med(f, 'heartbeat_probe_p99_all_s')} ms; long-poll overshoot p99 "
            f"{_med(f, 'long_poll_overshoot_p99_s')} ms; swarm loop lag p99 "
            f"{_med(f, 'swarm_loop_lag_p99_s')} ms; swarm CPU "
            f"{_med(f, 'swarm_cpu_fraction_of_a_core', '2')} cores"
        )
    jobs = result.get("jobs") or {}
    if "idle" in jobs:
        idle = jobs["idle"]
        lines.append(
            f"  GET /v1/jobs?all=true at {jobs['jobs']} jobs, idle: median {_t(idle['median'])}"
            f" [{_t(idle['min'])} - {_t(idle['max'])}], {idle['bytes']} bytes"
        )
    if "loaded" in jobs:
        ld = jobs["loaded"]
        hb = jobs["loaded_heartbeat_probe_s"]
        lines.append(
            f"  ... with {jobs['loaded_agents']} agents heartbeating: median {_t(ld['median'])}"
            f" [{_t(ld['min'])} - {_t(ld['max'])}]; probes meanwhile p50 {_t(hb['p50'])},"
            f" p99 {_t(hb['p99_all'])}"
        )
    for t in result["targets"]:
        lines.append(f"  target {t['what']}: {t['verdict']} ({t['value']})")
    return "\n".join(lines)


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    at = [r for r in result["agents"] if r["agents"] == TARGET_HB_AGENTS and "summary" in r]
    if at:
        v = at[0]["summary"]["heartbeat_probe_p99_all_s"]["median"]
        ok = v is not None and v < TARGET_HB_P99_S
        out.append(
            {
                "what": f"heartbeat p99 < {TARGET_HB_P99_S * 1000:.0f} ms at {TARGET_HB_AGENTS}",
                "value": _t(v),
                "verdict": "PASS" if ok else "FAIL",
            }
        )
    jobs = result.get("jobs") or {}
    if "idle" in jobs:
        v = jobs["idle"]["median"]
        ok = v is not None and v < TARGET_LIST_S
        out.append(
            {
                "what": f"GET /v1/jobs at {jobs['jobs']} jobs < {TARGET_LIST_S * 1000:.0f} ms",
                "value": f"{_t(v)} idle",
                "verdict": "PASS" if ok else "FAIL",
            }
        )
    return out


def compare_shapes(result: dict[str, Any]) -> None:
    """Do the pre-populated jobs look like a job completed through the API? (Both examples
    go into the JSON; the agents phases' copies are dropped.)"""
    api_jobs = [r["final"].pop("completed_job", None) for r in result["agents"] if "final" in r]
    api_job = next((j for j in api_jobs if j is not None), None)
    jobs = result.get("jobs") or {}
    made = jobs.pop("completed_job", None)
    if api_job is not None and made is not None:
        jobs["same_shape_as_an_api_job"] = shape(api_job) == shape(made)
        jobs["api_job_example"] = api_job
        jobs["prepopulated_job_example"] = made


def src_facts(src: Path | None) -> dict[str, Any]:
    if src is None:
        return {"src": None}
    out: dict[str, Any] = {"src": str(src)}
    git = ["git", "-C", str(src)]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out["commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        out["dirty"] = bool(dirty.strip())
    return out


# -- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", default="100,500,1000", help="simulated agent counts")
    p.add_argument("--jobs", type=int, default=10000, help="jobs for the listing (0: skip)")
    p.add_argument("--jobs-agents", type=int, default=100, help="agents during a 2nd listing")
    p.add_argument("--quick", action="store_true", help="short windows, fewer jobs and agents")
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--window-s", type=float, default=8.0)
    p.add_argument("--warm-s", type=float, default=5.0)
    p.add_argument("--register-timeout-s", type=float, default=30.0)
    p.add_argument("--probe-every-s", type=float, default=5.0)
    p.add_argument("--start-spread-s", type=float, default=2.0)
    p.add_argument("--job-every-s", type=float, default=1.5)
    p.add_argument("--list-reps", type=int, default=7)
    p.add_argument(
        "--settle-s",
        type=float,
        default=20.0,
        help="wait this long for an overloaded controller to answer again before reading "
        "the final node and job states (else they are read from a restarted controller)",
    )
    p.add_argument(
        "--src",
        type=Path,
        default=os.environ.get("TRAINPOD_BENCH_SRC") or None,
        help="the trainpod source dir the controller runs (default: $TRAINPOD_BENCH_SRC, "
        "else this interpreter's trainpod)",
    )
    p.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the floor (the largest swarm against a do-nothing server)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--keep", type=Path, default=None, help="copy the logs to this dir")
    args = p.parse_args(argv)
    if args.quick:
        if args.agents == "100,500,1000":
            args.agents = "100,500"
        args.jobs = min(args.jobs, 2000)
        args.window_s = min(args.window_s, 3.0)
        args.warm_s = min(args.warm_s, 2.0)
        args.register_timeout_s = min(args.register_timeout_s, 15.0)
        args.list_reps = min(args.list_reps, 5)
        args.settle_s = min(args.settle_s, 10.0)
    args.agent_counts = [int(x) for x in str(args.agents).split(",") if x.strip()]
    if args.src is not None:
        args.src = Path(args.src).absolute()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, raise_interrupt)
    # Two connections per simulated agent, on both ends; the children inherit the limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, 8 * max([*args.agent_counts, args.jobs_agents]) + 1024)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, want), hard))
    root = Path(tempfile.mkdtemp(prefix="tp-bench-cp-"))
    t_start = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": "control_plane",
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "keep")},
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "agents": [],
    }
    failed = False
    try:
        imported = trainpod_imported_from(args.src, root)
        if args.src is not None and not imported.startswith(str(args.src)):
            raise SystemExit(f"--src {args.src} does not win: the controller imports {imported}")
        result["controller"] = {"trainpod": imported, **src_facts(args.src)}
        print(f"controller code: {imported}", flush=True)
        for n in args.agent_counts:
            print(f"phase: {n} simulated agents", flush=True)
            try:
                result["agents"].append(agents_phase(args, root, n))
            except (RuntimeError, OSError, httpx.HTTPError, ValueError) as exc:
                failed = True
                print(f"  failed: {exc}", flush=True)
                result["agents"].append({"agents": n, "error": str(exc)})
        if args.floor and args.agent_counts:
            n = max(args.agent_counts)
            print(f"phase: the floor, {n} simulated agents against a do-nothing server", flush=True)
            try:
                result["floor"] = floor_phase(args, root, n)
            except (RuntimeError, OSError, ValueError, KeyError) as exc:
                print(f"  failed: {exc}", flush=True)
                result["floor"] = {"agents": n, "error": str(exc)}
        if args.jobs:
            print(f"phase: GET /v1/jobs at {args.jobs} jobs", flush=True)
            try:
                result["jobs"] = jobs_phase(args, root)
            except (RuntimeError, OSError, httpx.HTTPError, ValueError, KeyError) as exc:
                failed = True
                print(f"  failed: {exc}", flush=True)
                result["jobs"] = {"jobs": args.jobs, "error": str(exc)}
        compare_shapes(result)
    finally:
        with signals_ignored():
            shutil.rmtree(root, ignore_errors=True)
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["duration_s"] = time.monotonic() - t_start
    result["targets"] = targets(result)
    result["config"]["src"] = str(args.src) if args.src else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(json_safe(result), indent=1) + "\n")
    print(render(result))
    print(f"wrote {args.out} ({result['duration_s']:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
