"""Turning API objects into tables and lines for people."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table

from trainpod.api.models import JobInfo, NodeInfo

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

_STATE_STYLE = {
    "idle": "green",
    "allocated": "cyan",
    "running": "cyan",
    "completed": "green",
    "failed": "red",
    "cancelled": "yellow",
    "suspect": "yellow",
    "queued": "white",
    "preempted": "magenta",
    "starting": "cyan",
    "stopping": "yellow",
    "setting_up": "blue",
    "provisioning": "blue",
}


def styled(state: str) -> str:
    style = _STATE_STYLE.get(state)
    return f"[{style}]{state}[/]" if style else state


def show_value(value: Any) -> str:
    """An event's value on one line: names joined by commas, ``bad->spare`` for a map."""
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return ",".join(f"{k}->{v}" for k, v in value.items())
    return str(value)


def ago(ts: float | None) -> str:
    if ts is None:
        return "-"
    d = max(0.0, time.time() - ts)
    if d < 60:
        return f"{d:.0f}s ago"
    if d < 3600:
        return f"{d / 60:.0f}m ago"
    return f"{d / 3600:.1f}h ago"


def duration(start: float | None, end: float | None) -> str:
    if start is None:
        return "-"
    d = (end or time.time()) - start
    return f"{d:.1f}s" if d < 120 else f"{d / 60:.1f}m"


def devices(n: NodeInfo) -> str:
    facts = n.facts.get("devices") or {}
    if not n.devices:
        return "-"
    if facts.get("kind") == "cuda":
        return f"{n.devices} gpu"
    return f"{n.devices} cpu-sim"


def nodes_table(nodes: list[NodeInfo]) -> Table:
    t = Table(box=None, pad_edge=False)
    for col in ("NODE", "GROUP", "ROLE", "STATE", "JOB", "DEVICES", "HEARTBEAT", "REASON"):
        t.add_column(col)
    for n in nodes:
        role = n.role + (" (spare)" if n.spare else "")
        reason = n.reason.splitlines()[0] if n.reason else ""
        t.add_row(
            n.name,
            n.group,
            role,
            styled(n.state),
            str(n.job_id or "-"),
            devices(n),
            ago(n.last_heartbeat),
            reason,
        )
    return t


def queue_order(jobs: list[JobInfo]) -> list[JobInfo]:
    """Jobs that hold nodes or ended, by id; then the waiting ones in scheduling order (as
    the scheduler's last pass ranked them), as squeue lists pending jobs by priority."""
    waiting = [j for j in jobs if j.queue_position is not None]
    rest = [j for j in jobs if j.queue_position is None]
    return rest + sorted(waiting, key=lambda j: (j.queue_position or 0, j.id))


def jobs_table(jobs: list[JobInfo]) -> Table:
    t = Table(box=None, pad_edge=False)
    for col in (
        "JOB",
        "NAME",
        "USER",
        "TEAM",
        "CLASS",
        "STATE",
        "NODES",
        "ATTEMPT",
        "STEP",
        "TIME",
        "POS",
        "START",
        "NODELIST/REASON",
    ):
        t.add_column(col)
    for j in queue_order(jobs):
        last = j.attempts[-1] if j.attempts else None
        where = ",".join(last.nodes) if last and not j.reason else j.reason.splitlines()[0:1]
        start = j.estimated_start
        t.add_row(
            str(j.id),
            j.name,
            j.spec.user or "-",
            j.spec.team or "-",
            j.spec.priority_class or "-",
            styled(j.state),
            f"{j.spec.nodes}x{j.spec.procs_per_node}",
            str(last.number if last else "-"),
            str((j.progress or {}).get("last_step", "-")),
            duration(j.started_at, j.ended_at),
            str(j.queue_position) if j.queue_position is not None else "-",
            time.strftime("%H:%M:%S", time.localtime(start)) if start is not None else "-",
            where if isinstance(where, str) else "".join(where),
        )
    return t
