"""The control-plane benchmark's moving parts: a controller with no agents, and a swarm of
simulated agents that speak the agent protocol over plain HTTP.

* :data:`SETUP_SCRIPT` runs in the *controller's* interpreter (``--src`` on its
  ``PYTHONPATH``): it writes the state dir exactly as ``trainpod cluster create`` does
  (``LocalBackend.create``: ``cluster.json``, ``admin.token``, ``agent.token``), minus the
  processes (``start()`` is a no-op), and optionally pre-populates the SQLite store with
  completed jobs through that trainpod's own ``Store``.
* :func:`start_controller` / :func:`stop_controller`: the real
  ``python -m trainpod.controller.daemon --state-dir DIR`` process, always stopped again
  (with anything it may have spawned).
* The swarm (``python controlplanekit.py swarm CONFIG.json``): one asyncio process that
  plays N agents. Each agent has a long-poll loop and a reporter, like
  :class:`trainpod.agent.agent.Agent`, over two keep-alive connections of a minimal
  HTTP/1.1 client (:class:`HttpConn`; a few tens of microseconds of CPU per request, where
  httpx costs several hundred: on two cores the load generator must stay far cheaper than
  what it measures). It imports nothing from trainpod: only the wire format counts. It
  writes every beat it sent (kind, send/receive times, outcome) to a JSON results file
  when it gets SIGTERM (or its parent dies, or ``max_s`` passes).
* The floor (``python controlplanekit.py stub``): a server that answers heartbeats with
  fixed orders and does nothing else, to show what the swarm and this machine's load add
  to every figure by themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

RETRY_S = 0.5  # trainpod.agent.agent.RETRY_S: the pause after a failed beat
CLIENT_SLACK_S = 15.0  # TrainpodClient.heartbeat: timeout = wait_s + 15 s
RANK_RUN_S = 0.05  # how long a simulated /bin/true rank "runs" before it exits
READY_TIMEOUT_S = 60.0

# -- the controller's side ---------------------------------------------------------------------
SETUP_SCRIPT = r'''
import json, sys, time
from pathlib import Path

import trainpod
from trainpod.backends.local import LocalBackend
from trainpod.paths import ClusterPaths
from trainpod.spec.loading import load_cluster_spec

args = json.loads(sys.argv[1])


class ControllerOnly(LocalBackend):
    """LocalBackend.create() writes the state dir; its start() would spawn the controller
    and an agent per node. The benchmark starts the controller itself and no agent."""

    def start(self):
        return []


spec_path = Path(args["spec_path"])
spec = load_cluster_spec(spec_path)
paths = ClusterPaths.of(spec.name, Path(args["home"]))
record = ControllerOnly(paths).create(spec, spec_path)
nodes = [name for name, _ in spec.node_names()]
out = {
    "url": record.url,
    "state_dir": str(paths.state_dir),
    "admin_token": str(paths.admin_token),
    "agent_token": str(paths.agent_token),
    "log": str(paths.log_file("controller")),
    "trainpod_file": trainpod.__file__,
    "nodes": nodes,
    "prepopulated_jobs": 0,
}
n = int(args.get("jobs", 0))
if n:
    # Completed one-node /bin/true jobs as the controller leaves them: the job row (its
    # resolved spec), one succeeded attempt with one exited rank, and the events a job
    # completed through the API has (the same kinds and order).
    from trainpod.spec.job import JobSpec
    from trainpod.store.repo import Store

    t_setup = time.perf_counter()
    part = spec.default_partition().name
    job = JobSpec.model_validate(args["job"])
    job = job.model_copy(update={"procs_per_node": 1, "partition": part})
    body = job.model_dump(mode="json")
    store = Store.open(paths.db)
    t0 = time.time() - 0.2 * n
    with store.transaction():
        for i in range(n):
            t = t0 + 0.2 * i
            node = nodes[i % len(nodes)]
            port = 20000 + i % 20000
            jid = store.insert_job(job.display_name(), body, t)
            ev = store.add_event
            ev(t, "job_submitted", job_id=jid, nodes=1, procs_per_node=1, partition=part,
               user=job.user, command=job.command, auto_resume=False)
            t += 0.01
            aid = store.insert_attempt(jid, 1, [node], "127.0.0.1", port, 1, t)
            store.update_job(jid, t, state="starting")
            ev(t, "node_state", node=node, old="idle", new="allocated", reason="")
            ev(t, "job_state", job_id=jid, old="queued", new="starting", reason="")
            ev(t, "attempt_created", job_id=jid, attempt=1, attempt_id=aid, nodes=[node],
               master_addr="127.0.0.1", master_port=port, restart_reason="")
            t += 0.01
            store.update_rank(aid, 0, state="running", pid=100000 + i, started_at=t)
            ev(t, "rank_started", node=node, job_id=jid, attempt=1, rank=0, pid=100000 + i,
               started_at=t)
            store.update_attempt(aid, state="running", started_at=t)
            ev(t, "attempt_state", job_id=jid, attempt=1, old="launching", new="running",
               cause="")
            store.update_job(jid, t, state="running", started_at=t)
            ev(t, "job_state", job_id=jid, old="starting", new="running", reason="")
            ev(t, "job_first_start", job_id=jid)
            t += 0.05
            store.update_rank(aid, 0, state="exited", exit_code=0, signal=None, ended_at=t)
            ev(t, "rank_exited", node=node, job_id=jid, attempt=1, rank=0, exited_at=t,
               exit_code=0, signal=None)
            store.update_attempt(aid, state="succeeded", ended_at=t)
            ev(t, "attempt_state", job_id=jid, attempt=1, old="running", new="succeeded",
               cause="")
            ev(t, "node_state", node=node, old="allocated", new="idle", reason="")
            ev(t, "node_released", node=node, job_id=jid)
            store.update_job(jid, t, state="completed", ended_at=t)
            ev(t, "job_state", job_id=jid, old="running", new="completed", reason="")
    store.close()
    out["prepopulated_jobs"] = n
    out["prepopulate_s"] = time.perf_counter() - t_setup
print(json.dumps(out))
'''


def controller_env(src: Path | None) -> dict[str, str]:
    """The environment of the controller's processes: ``src`` first on PYTHONPATH."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p
        )
    env.pop("TRAINPOD_HOME", None)
    return env


def trainpod_imported_from(src: Path | None, cwd: Path) -> str:
    """Which trainpod the controller's interpreter imports (the --src override must win)."""
    out = subprocess.run(
        [sys.executable, "-c", "import trainpod; print(trainpod.__file__)"],
        env=controller_env(src),
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip()


def setup_state_dir(
    src: Path | None, home: Path, spec_yaml: str, jobs: int = 0, job: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write a cluster's state dir under ``home`` (and pre-populate ``jobs``); its facts."""
    home.mkdir(parents=True, exist_ok=True)
    spec_path = home / "cluster.yaml"
    spec_path.write_text(spec_yaml)
    args = {"spec_path": str(spec_path), "home": str(home), "jobs": jobs, "job": job or {}}
    out = subprocess.run(
        [sys.executable, "-c", SETUP_SCRIPT, json.dumps(args)],
        env=controller_env(src),
        cwd=home,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"setting up the state dir failed:\n{out.stderr[-3000:]}")
    info: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    info["admin_token"] = Path(info["admin_token"]).read_text().strip()
    info["agent_token"] = Path(info["agent_token"]).read_text().strip()
    return info


def start_controller(src: Path | None, info: dict[str, Any], cwd: Path) -> subprocess.Popen[bytes]:
    log = Path(info["log"])
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "trainpod.controller.daemon", "--state-dir", info["state_dir"]],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=controller_env(src),
            cwd=cwd,
            start_new_session=True,
        )


def wait_ready(proc: subprocess.Popen[bytes], info: dict[str, Any]) -> float:
    """Block until ``GET /v1/cluster`` answers; the seconds it took. Raises if it died."""
    import httpx

    t0 = time.monotonic()
    headers = {"Authorization": f"Bearer {info['admin_token']}"}
    with httpx.Client(base_url=info["url"], headers=headers, timeout=2, trust_env=False) as c:
        while True:
            try:
                if c.get("/v1/cluster").status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > READY_TIMEOUT_S:
                tail = Path(info["log"]).read_text()[-3000:]
                raise RuntimeError(f"the controller did not come up; its log ends with:\n{tail}")
            time.sleep(0.05)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float) -> int | None:
    """SIGTERM, then SIGKILL after ``grace_s``; also kill whatever it spawned."""
    if proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads); NaN if it is gone."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return float("nan")
    return float(t.user + t.system)


# -- the swarm ---------------------------------------------------------------------------------
class HttpError(Exception):
    """The server answered something this client does not understand."""


class HttpConn:
    """One keep-alive HTTP/1.1 connection: POST a JSON body, read the whole response."""

    def __init__(self, host: str, port: int, token: str, stats: Counter[str]) -> None:
        self.host = host
        self.port = port
        self._auth = f"Authorization: Bearer {token}\r\n"
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._stats = stats

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def post(self, path: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
        try:
            return await asyncio.wait_for(self._post(path, body), timeout_s)
        except BaseException:
            self.close()  # a timed-out or cancelled exchange leaves the stream mid-response
            raise

    async def _post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self._auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        for retry in (False, True):
            reused = self._reader is not None and not self._reader.at_eof()
            if not reused:
                self.close()
                self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
                self._stats["connections_opened"] += 1
            assert self._reader is not None and self._writer is not None
            try:
                self._writer.write(head + body)
                await self._writer.drain()
                return await self._response(self._reader)
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if not reused or retry:
                    raise
                self._stats["stale_connection_retries"] += 1  # the server closed it idle
        raise AssertionError("unreachable")

    async def _response(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        parts = head[0].split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise HttpError(f"bad status line {head[0]!r}")
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip().lower()
        if "content-length" in headers:
            data = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            chunks = []
            while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                chunks.append(await reader.readexactly(size))
                await reader.readexactly(2)
            await reader.readuntil(b"\r\n")
            data = b"".join(chunks)
        else:
            data = await reader.read()
            headers["connection"] = "close"
        if headers.get("connection") == "close":
            self.close()
        return int(parts[1]), data


@dataclass
class Recorder:
    """Every beat the swarm sent, as columns (times are ``time.monotonic()``)."""

    kind: list[str] = field(default_factory=list)  # poll | probe | report
    node: list[int] = field(default_factory=list)  # index into the config's node list
    t_send: list[float] = field(default_factory=list)
    t_recv: list[float] = field(default_factory=list)
    outcome: list[str] = field(default_factory=list)  # ok|timeout|unanswered|error:<what>
    held: list[int] = field(default_factory=list)  # 1: a long poll answered unchanged orders
    wait_s: list[float] = field(default_factory=list)
    launches: dict[int, list[Any]] = field(default_factory=dict)  # job -> [t, node, attempt]
    registered: dict[str, float] = field(default_factory=dict)  # node -> first answer
    lag: list[list[float]] = field(default_factory=list)  # [t, event-loop lag s]
    stats: Counter[str] = field(default_factory=Counter)

    def add(
        self, kind: str, node: int, t0: float, t1: float, outcome: str, held: bool, w: float
    ) -> None:
        self.kind.append(kind)
        self.node.append(node)
        self.t_send.append(t0)
        self.t_recv.append(t1)
        self.outcome.append(outcome)
        self.held.append(int(held))
        self.wait_s.append(w)
        self.stats[f"{kind}:{outcome}"] += 1


@dataclass
class SimRun:
    job_id: int
    ranks: list[dict[str, Any]]


def _static_payload(node: str, index: int) -> str:
    """The parts of a heartbeat that stay the same, shaped like a real agent's (node facts
    and the five health checks a local agent reports every beat), JSON without the final
    brace."""
    reading = {
        "ecc_uncorrected_volatile": 0, "errors": {}, "index": 0, "lost": False,
        "memory_total_mib": 81920.0, "memory_used_mib": 0.0,
        "name": "simulated GPU (CPU slot)", "pci_bus_id": "00000000:01:00.0", "power_w": 100.0,
        "remap_failure": False, "remap_pending": False, "retired_pages_pending": False,
        "temperature_c": 40.0, "throttle_reasons": [], "utilization_pct": 0.0,
    }  # fmt: skip
    disk = {"free_gib": 78.6, "total_gib": 252.0, "write_ok": True}
    health = [
        {"check": "gpu", "status": "ok", "reason": "simulated GPU: 1 GPUs healthy",
         "simulated": True, "facts": {"count": 1, "expected_count": 1, "readings": [reading],
                                      "source": "simulated", "sticky_faults": [],
                                      "xid_history": [], "xids": []}},
        {"check": "disk", "status": "ok", "reason": "2 paths writable", "simulated": False,
         "facts": {"scratch": {**disk, "path": f"/scratch/{node}"},
                   "shared": {**disk, "path": "/shared"}}},
        {"check": "memory", "status": "ok", "reason": "memory 6.5% used", "simulated": False,
         "facts": {"available_gib": 22.0, "percent": 6.5, "total_gib": 23.5}},
        {"check": "clock", "status": "ok", "reason": "clock 0.0046 s ahead",
         "simulated": False, "facts": {"reference": time.time(), "skew_s": 0.0046}},
        {"check": "network", "status": "ok", "reason": "1 targets reachable",
         "simulated": False, "facts": {"controller": {"host": "127.0.0.1", "latency_ms": 0.15,
                                                      "ok": True, "port": 1}}},
    ]  # fmt: skip
    facts = {
        "hostname": node, "python": "3.11.7", "cpus": 2, "load1": 1.0,
        "mem_total_gib": 23.5, "mem_available_gib": 22.0, "scratch_free_gib": 78.6,
        "devices": {"kind": "cpu", "count": 1, "visible": [], "simulated": True},
    }  # fmt: skip
    doc = {
        "node": node,
        "agent_id": uuid.uuid4().hex,
        "agent_pid": 1_000_000 + index,
        "address": "127.0.0.1",
        "facts": facts,
        "lifecycle": {"state": "ok", "results": []},
        "health": health,
    }
    return json.dumps(doc)[:-1]


class SimAgent:
    """One node's agent: a long-poll loop (``wait_s`` = the orders' heartbeat interval,
    ``orders_hash`` echoed) and a reporter (a ``wait_s=0`` beat when its simulated ranks
    changed, and a probe beat every ``probe_every_s``), over two connections."""

    def __init__(self, swarm: Swarm, node: str, index: int) -> None:
        self.swarm = swarm
        self.node = node
        self.index = index
        self._static = _static_payload(node, index)
        self.orders_hash: str | None = None
        self.interval = 1.0
        self.runs: dict[int, SimRun] = {}
        self.seen: set[int] = set()
        self.changed = asyncio.Event()
        host, port = swarm.host, swarm.port
        self.poll_conn = HttpConn(host, port, swarm.token, swarm.rec.stats)
        self.report_conn = HttpConn(host, port, swarm.token, swarm.rec.stats)

    def _attempts(self) -> list[dict[str, Any]]:
        return [
            {"attempt_id": aid, "job_id": run.job_id, "ranks": [dict(r) for r in run.ranks]}
            for aid, run in sorted(self.runs.items())
        ]

    async def beat(self, conn: HttpConn, kind: str, wait_s: float) -> dict[str, Any] | None:
        sent_hash = self.orders_hash if wait_s else None
        attempts = self._attempts()
        body = (
            f'{self._static},"attempts":{json.dumps(attempts)},'
            f'"orders_hash":{json.dumps(sent_hash)},"wait_s":{wait_s},"time":{time.time()}}}'
        ).encode()
        rec = self.swarm.rec
        t0 = time.monotonic()
        try:
            status, data = await conn.post("/v1/agent/heartbeat", body, wait_s + CLIENT_SLACK_S)
        except asyncio.CancelledError:  # the swarm stops with this beat still unanswered
            rec.add(kind, self.index, t0, time.monotonic(), "unanswered", False, wait_s)
            raise
        except asyncio.TimeoutError:
            rec.add(kind, self.index, t0, time.monotonic(), "timeout", False, wait_s)
            return None
        except (OSError, asyncio.IncompleteReadError, HttpError, ValueError) as exc:
            what = f"error:{type(exc).__name__}"
            rec.add(kind, self.index, t0, time.monotonic(), what, False, wait_s)
            return None
        t1 = time.monotonic()
        if status != 200:
            rec.add(kind, self.index, t0, t1, f"error:http {status}", False, wait_s)
            return None
        orders: dict[str, Any] = json.loads(data)
        held = bool(wait_s) and orders["hash"] == sent_hash
        rec.add(kind, self.index, t0, t1, "ok", held, wait_s)
        rec.registered.setdefault(self.node, t1)
        self._delivered(attempts)
        self._apply(orders, t1)
        return orders

    def _delivered(self, attempts: list[dict[str, Any]]) -> None:
        """As Launcher.delivered: forget an attempt once its exits reached the controller."""
        for rep in attempts:
            if all(r["state"] == "exited" for r in rep["ranks"]):
                run = self.runs.get(rep["attempt_id"])
                if run is not None and all(r["state"] == "exited" for r in run.ranks):
                    del self.runs[rep["attempt_id"]]

    def _apply(self, orders: dict[str, Any], t: float) -> None:
        self.orders_hash = orders["hash"]
        self.interval = float(orders.get("heartbeat_interval_s", 1.0))
        loop = asyncio.get_running_loop()
        for kill in orders.get("kill", []):
            run = self.runs.get(kill["attempt_id"])
            if run is not None and any(r["state"] == "running" for r in run.ranks):
                loop.call_later(min(float(kill["grace_s"]), RANK_RUN_S), self._exit, run, 15)
        for launch in orders.get("launch", []):
            self.swarm.rec.launches.setdefault(
                int(launch["job_id"]), [t, self.node, launch["attempt_id"]]
            )
            if launch["attempt_id"] in self.seen:
                continue
            self.seen.add(launch["attempt_id"])
            now = time.time()
            ranks = [
                {"rank": s["rank"], "local_rank": s["local_rank"], "pid": 4_000_000 + s["rank"],
                 "state": "running", "exit_code": None, "signal": None, "started_at": now,
                 "ended_at": None, "log_tail": ""}
                for s in launch["ranks"]
            ]  # fmt: skip
            run = SimRun(job_id=int(launch["job_id"]), ranks=ranks)
            self.runs[launch["attempt_id"]] = run
            self.changed.set()
            loop.call_later(RANK_RUN_S, self._exit, run, None)

    def _exit(self, run: SimRun, sig: int | None) -> None:
        for r in run.ranks:
            if r["state"] == "running":
                r.update(state="exited", exit_code=0 if sig is None else None, signal=sig)
                r["ended_at"] = time.time()
        self.changed.set()

    async def beat_loop(self) -> None:
        while not self.swarm.stopping:
            if await self.beat(self.poll_conn, "poll", self.interval) is None:
                await asyncio.sleep(RETRY_S)

    async def report_loop(self, probe_every_s: float) -> None:
        next_probe = time.monotonic() + random.uniform(0, probe_every_s)
        while not self.swarm.stopping:
            kind = "report"
            try:
                left = max(0.0, next_probe - time.monotonic())
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                kind = "probe"
                next_probe = time.monotonic() + probe_every_s
            self.changed.clear()
            if await self.beat(self.report_conn, kind, 0.0) is None:
                if kind == "report":
                    self.changed.set()  # deliver it once the controller answers again
                await asyncio.sleep(RETRY_S)

    def close(self) -> None:
        self.poll_conn.close()
        self.report_conn.close()


class Swarm:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        host, _, port = cfg["url"].removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)
        self.token: str = cfg["agent_token"]
        self.rec = Recorder()
        self.agents = [SimAgent(self, n, i) for i, n in enumerate(cfg["nodes"])]
        self._tasks: list[asyncio.Task[None]] = []
        # Checked by every loop: asyncio.wait_for (3.11) may swallow a cancellation that
        # arrives as its inner call completes, so cancelling alone cannot stop a loop.
        self.stopping = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tasks = [
            asyncio.create_task(self._status(stop)),
            asyncio.create_task(self._lag()),
            asyncio.create_task(self._start_agents()),
        ]
        await stop.wait()
        self.stopping = True
        every = [*tasks, *self._tasks]
        for t in every:
            t.cancel()
        _, pending = await asyncio.wait(every, timeout=5.0)
        for t in pending:  # one more try; whatever still runs is abandoned at exit
            t.cancel()
        for a in self.agents:
            a.close()

    async def _start_agents(self) -> None:
        """Start the agents spread evenly over ``start_spread_s`` (as a cluster's agents
        come up over time rather than in one instant)."""
        spread = float(self.cfg["start_spread_s"]) / max(1, len(self.agents))
        t0 = time.monotonic()
        for i, a in enumerate(self.agents):
            delay = t0 + i * spread - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self._tasks.append(asyncio.create_task(a.beat_loop()))
            self._tasks.append(asyncio.create_task(a.report_loop(self.cfg["probe_every_s"])))

    async def _lag(self) -> None:
        """How late the event loop wakes up: the swarm's own share of any latency."""
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(0.05)
            t1 = time.monotonic()
            self.rec.lag.append([t1, t1 - t0 - 0.05])

    async def _status(self, stop: asyncio.Event) -> None:
        path = Path(self.cfg["status_path"])
        deadline = time.monotonic() + float(self.cfg["max_s"])
        parent = os.getppid()
        while True:
            doc = {"registered": len(self.rec.registered), "stats": dict(self.rec.stats)}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, path)
            if time.monotonic() > deadline or os.getppid() != parent:
                stop.set()
            await asyncio.sleep(0.25)

    def write(self, path: Path) -> None:
        r = self.rec
        doc = {
            "columns": {
                "kind": r.kind, "node": r.node, "t_send": r.t_send, "t_recv": r.t_recv,
                "outcome": r.outcome, "held": r.held, "wait_s": r.wait_s,
            },
            "launches": r.launches,
            "registered": r.registered,
            "lag": r.lag,
            "stats": dict(r.stats),
        }  # fmt: skip
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)


def swarm_main(config_path: Path) -> None:
    cfg = json.loads(config_path.read_text())
    swarm = Swarm(cfg)
    asyncio.run(swarm.run())
    swarm.write(Path(cfg["results_path"]))


def start_swarm(cfg: dict[str, Any], workdir: Path) -> subprocess.Popen[bytes]:
    """The swarm in its own process (this file, run as a script); see :func:`swarm_main`."""
    config = workdir / "swarm.json"
    config.write_text(json.dumps(cfg))
    with (workdir / "swarm.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "swarm", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def swarm_status(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {"registered": 0, "stats": {}}


# -- the floor: the swarm against a server that does nothing -----------------------------------
_STUB_ORDERS = json.dumps(
    {"launch": [], "kill": [], "deep_check": None, "chaos": [], "heartbeat_interval_s": 1.0,
     "active_jobs": [], "leave": None, "controller_time": 0.0, "hash": "0" * 16}
).encode()  # fmt: skip


async def _stub_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer heartbeats with fixed orders, holding a long poll that already has them for
    its ``wait_s``: the least any controller could do."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    try:
        while True:
            lines = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
            size = next(int(x.split(b":")[1]) for x in lines if x.lower().startswith(b"content-l"))
            hb = json.loads(await reader.readexactly(size))
            if hb.get("wait_s") and hb.get("orders_hash") == "0" * 16:
                await asyncio.sleep(float(hb["wait_s"]))
            writer.write(head % len(_STUB_ORDERS) + _STUB_ORDERS)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError, ValueError, StopIteration):
        writer.close()
    except asyncio.CancelledError:  # the server is stopping: end quietly
        writer.close()


async def _stub_main() -> None:
    server = await asyncio.start_server(_stub_conn, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def start_stub() -> tuple[subprocess.Popen[bytes], str]:
    """The floor server in its own process (this file, run as a script); it and its URL."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "stub"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    port = proc.stdout.readline().decode().strip()
    if not port.isdigit():
        stop_process(proc, 5.0)
        raise RuntimeError("the floor server did not start")
    return proc, f"http://127.0.0.1:{port}"


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "swarm":
    swarm_main(Path(sys.argv[2]))
elif __name__ == "__main__" and sys.argv[1:] == ["stub"]:
    asyncio.run(_stub_main())
