"""``trainpod top``: a live terminal view of nodes, devices, jobs and the queue (like nvtop
meets squeue), redrawn in place until q or Ctrl-C.

The screen is a pure function of what the API returns (:func:`screen`); the loop around it
(:func:`run_top`) reads, draws with rich's ``Live`` and waits for a key or the interval.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from trainpod.api.models import JobInfo, NodeInfo
from trainpod.cli.context import client_for
from trainpod.cli.render import ago, devices, duration, queue_order, styled
from trainpod.client.http import TrainpodClient

CLUSTER_OPT = typer.Option(None, "--cluster", "-c", help="cluster name (default: current)")
_WAITING = ("queued", "preempted")


@dataclass
class Frame:
    """One look at the cluster: what a screen is drawn from."""

    cluster: str
    at: float
    nodes: list[NodeInfo]
    jobs: list[JobInfo]
    telemetry: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Node -> its devices and their samples (``/v1/nodes/{name}/telemetry``), for the nodes
    that have any."""


def screen(frame: Frame, height: int = 50) -> RenderableType:
    """The whole screen for ``frame``; tables are cut to fit ``height`` lines."""
    waiting = [j for j in queue_order(frame.jobs) if j.state in _WAITING]
    running = [j for j in frame.jobs if j.state not in _WAITING and not j.state.ended]
    states: dict[str, int] = {}
    for n in frame.nodes:
        states[n.state] = states.get(n.state, 0) + 1
    head = Text.from_markup(
        f"[bold]trainpod top[/] · cluster [bold]{frame.cluster}[/] · "
        + time.strftime("%H:%M:%S", time.localtime(frame.at))
        + " · nodes "
        + " ".join(f"{styled(s)} {c}" for s, c in sorted(states.items()))
        + f" · jobs running {len(running)} waiting {len(waiting)}"
        + "   [dim](q quits)[/]"
    )
    budget = max(3, (height - 12) // 4)
    parts: list[RenderableType] = [head, _nodes(frame.nodes[:budget], len(frame.nodes))]
    dev = _devices(frame, budget)
    if dev is not None:
        parts.append(dev)
    parts += [_running(running[:budget], len(running)), _queue(waiting[:budget], len(waiting))]
    return Group(*parts)


def _table(title: str, *cols: str) -> Table:
    t = Table(title=title, title_justify="left", box=None, pad_edge=False, expand=True)
    for c in cols:
        t.add_column(c, no_wrap=True, overflow="ellipsis")
    return t


def _more(t: Table, shown: int, total: int) -> Table:
    if total > shown:
        t.caption = f"… and {total - shown} more"
    return t


def _nodes(nodes: list[NodeInfo], total: int) -> Table:
    t = _table("NODES", "NODE", "STATE", "JOB", "DEVICES", "HEALTH", "HEARTBEAT", "REASON")
    for n in nodes:
        health = n.facts.get("health") or []
        bad = [h["check"] for h in health if h.get("status") != "ok"]
        t.add_row(
            n.name,
            styled(n.state),
            str(n.job_id or "-"),
            devices(n),
            ("[yellow]" + ",".join(bad) + "[/]") if bad else ("ok" if health else "-"),
            ago(n.last_heartbeat),
            n.reason.splitlines()[0] if n.reason else "",
        )
    return _more(t, len(nodes), total)


def _devices(frame: Frame, budget: int) -> Table | None:
    """Per device, its latest sample; None when no node has telemetry."""
    if not frame.telemetry:
        return None
    t = _table("DEVICES", "NODE", "DEV", "NAME", "UTIL", "MEMORY", "POWER", "TEMP")
    rows = 0
    for node, devs in frame.telemetry.items():
        for d in devs:
            samples = d.get("samples") or []
            if not samples or rows >= budget:
                continue
            s = samples[-1]
            used, total = s.get("memory_used_bytes"), s.get("memory_total_bytes")
            mem = f"{used / 2**30:.1f}/{total / 2**30:.1f} GiB" if used and total else "-"
            name = str(d.get("name", "")) + (" (simulated)" if d.get("simulated") else "")
            t.add_row(
                node,
                str(d.get("index", "")),
                name,
                _num(s.get("utilization_pct"), "%"),
                mem,
                _num(s.get("power_w"), " W"),
                _num(s.get("temperature_c"), " C"),
            )
            rows += 1
    return t


def _num(v: object, unit: str) -> str:
    return f"{v:.0f}{unit}" if isinstance(v, int | float) else "-"


def _running(jobs: list[JobInfo], total: int) -> Table:
    t = _table("JOBS", "JOB", "NAME", "USER", "STATE", "ATT", "STEP", "STEP/S", "TIME", "NODES")
    for j in jobs:
        p = j.progress or {}
        last = j.attempts[-1] if j.attempts else None
        st = p.get("step_time_s")
        t.add_row(
            str(j.id),
            j.name,
            j.spec.user or "-",
            styled(j.state),
            str(last.number if last else "-"),
            str(p.get("last_step", "-")),
            f"{1 / st:.2f}" if st else "-",
            duration(j.started_at, j.ended_at),
            ",".join(last.nodes) if last else "-",
        )
    return _more(t, len(jobs), total)


def _queue(jobs: list[JobInfo], total: int) -> Table:
    t = _table("QUEUE", "POS", "JOB", "NAME", "USER", "SHAPE", "START", "REASON")
    for j in jobs:
        start = j.estimated_start
        t.add_row(
            str(j.queue_position) if j.queue_position is not None else "-",
            str(j.id),
            j.name,
            j.spec.user or "-",
            f"{j.spec.nodes}x{j.spec.procs_per_node or '-'}",
            time.strftime("%H:%M:%S", time.localtime(start)) if start else "-",
            j.reason.splitlines()[0] if j.reason else "",
        )
    return _more(t, len(jobs), total)


class _Telemetry:
    """Asks for the nodes' telemetry, until the controller says it has no such route."""

    def __init__(self) -> None:
        self.absent = False

    def read(
        self, client: TrainpodClient, nodes: list[NodeInfo]
    ) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for n in nodes:
            if self.absent:
                break
            devs = client.node_telemetry(n.name)
            if devs is None:
                self.absent = not out  # a 404 for the first node asked: no route at all
                continue
            if devs:
                out[n.name] = devs
        return out


def look(client: TrainpodClient, cluster: str, telemetry: _Telemetry, rows: int) -> Frame:
    nodes = client.nodes()
    jobs = client.jobs(include_ended=False)
    return Frame(cluster, time.time(), nodes, jobs, telemetry.read(client, nodes[:rows]))


@contextlib.contextmanager
def _keys() -> Iterator[bool]:
    """stdin in cbreak mode (a key arrives without Enter; Ctrl-C still interrupts) while
    inside; yields whether stdin is a terminal (else no key is read)."""
    if not sys.stdin.isatty():
        yield False
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _wait_key(interval_s: float, keys: bool) -> str:
    """The key pressed within ``interval_s`` (empty: none)."""
    if not keys:
        time.sleep(interval_s)
        return ""
    ready, _, _ = select.select([sys.stdin], [], [], interval_s)
    return os.read(sys.stdin.fileno(), 1).decode(errors="replace") if ready else ""


def run_top(client: TrainpodClient, cluster: str, interval_s: float, once: bool) -> None:
    console = Console()
    telemetry = _Telemetry()
    if once:
        console.print(screen(look(client, cluster, telemetry, 20), console.size.height))
        return
    with _keys() as keys, Live(console=console, screen=True, auto_refresh=False) as live:
        while True:
            rows = max(3, console.size.height // 4)
            frame = look(client, cluster, telemetry, rows)
            live.update(screen(frame, console.size.height), refresh=True)
            if _wait_key(interval_s, keys).lower() == "q":
                return


def top(
    interval: float = typer.Option(1.0, "--interval", "-n", min=0.1, help="seconds per refresh"),
    once: bool = typer.Option(False, "--once", help="print one screen and exit"),
    cluster: str = CLUSTER_OPT,
) -> None:
    """A live view of nodes, devices, jobs and the queue; q or Ctrl-C quits."""
    with client_for(cluster) as client:
        name = client.cluster().name
        try:
            run_top(client, name, interval, once)
        except KeyboardInterrupt:
            pass
