"""Goodput for people: a headline, the buckets and the timeline of attempts and faults.

``render`` only prints a ``GoodputReport``; ``trainpod goodput JOB [--json]`` (wired in the
CLI's main module) fetches the job and its events and calls ``compute_goodput`` first.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trainpod.telemetry import GoodputReport

_BAR = 24
_STYLE = {"productive": "green", "unaccounted": "dim", "running_no_beacons": "cyan"}
_ENDED_STYLE = {"succeeded": "green", "failed": "red", "cancelled": "yellow"}


def fmt_duration(seconds: float) -> str:
    """``45.2s``, ``12m04s``, ``1h02m03s``."""
    s = max(0.0, seconds)
    if round(s, 1) < 60:
        return f"{s:.1f}s"
    m, sec = divmod(round(s), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def fmt_offset(seconds: float) -> str:
    """Time since submit: ``+12.3s``, ``+1m02.3s``, ``+1h02m03.4s``."""
    sign, s = ("-" if seconds < 0 else "+"), round(abs(seconds), 1)
    if s < 60:
        return f"{sign}{s:.1f}s"
    m, sec = divmod(s, 60)
    h, m = divmod(int(m), 60)
    return f"{sign}{h}h{m:02d}m{sec:04.1f}s" if h else f"{sign}{m}m{sec:04.1f}s"


def headline(report: GoodputReport) -> str:
    """``job 7: goodput 87.3% of 12m04s wall; ETTR 91.0%``, or why it is unknown."""
    wall, r = fmt_duration(report.wall_s), report
    running = "" if r.ended_at is not None else f" ({r.state}, so far)"
    blind = r.buckets.get("running_no_beacons", 0.0)
    if blind > 0 and r.buckets.get("productive", 0.0) == 0:
        return f"job {r.job_id}: goodput unknown (no progress beacons) over {wall} wall{running}"
    share = f"; {blind / r.wall_s:.1%} of it without beacons" if blind > 0 else ""
    return (
        f"job {r.job_id}: goodput {r.goodput:.1%} of {wall} wall; ETTR {r.ettr:.1%}{share}{running}"
    )


def buckets_table(report: GoodputReport) -> Table:
    t = Table(box=None, pad_edge=False)
    t.add_column("BUCKET")
    t.add_column("SECONDS", justify="right")
    t.add_column("% WALL", justify="right")
    t.add_column("")
    for name, secs in report.buckets.items():
        if secs <= 0 and name != "productive":
            continue
        frac = secs / report.wall_s if report.wall_s > 0 else 0.0
        style = _STYLE.get(name, "yellow")
        bar = "█" * round(frac * _BAR) or ("▏" if secs > 0 else "")
        t.add_row(name, f"{secs:.1f}", f"{frac:.1%}", f"[{style}]{bar}[/]")
    return t


def timeline(report: GoodputReport) -> list[tuple[float, str]]:
    """(seconds since submit, what happened), in time order."""
    t0 = report.submitted_at
    rows: list[tuple[float, str]] = [(0.0, "submitted")]
    faults = {a.number: a.fault for a in report.attempts}

    def at(ts: float | None, text: str) -> None:
        if ts is not None:
            rows.append((ts - t0, text))

    for a in report.attempts:
        n, where = a.number, escape(",".join(a.nodes) or "?")
        why = f" after {faults.get(n - 1) or 'a failure'}" if n > 1 else ""
        swap = f" (replaced {escape(','.join(a.replaced))}{why})" if a.replaced else ""
        at(a.created_at, f"attempt {n} started on {where}{swap}")
        at(a.first_rank_at, f"attempt {n}: first rank running")
        step = f" (step {a.first_step})" if a.first_step is not None else ""
        at(a.first_beacon_at, f"attempt {n}: first progress beacon{step}")
        step = f" (step {a.last_step})" if a.last_step is not None else ""
        at(a.last_beacon_at, f"attempt {n}: last progress beacon{step}")
        at(a.waiting_since, f"attempt {n}: recovery waits for a spare node")
        cause = f" ({escape(a.cause)})" if a.cause else ""
        style = _ENDED_STYLE.get(a.state, "white")
        at(a.ended_at, f"attempt {n} [{style}]{a.state}[/]{cause}")
    for f in report.faults:
        where = escape(",".join(f.nodes) or "?") + (f" rank {f.rank}" if f.rank is not None else "")
        reason = f": {escape(f.reason)}" if f.reason else ""
        lag = fmt_duration(f.detected_at - f.fault_at)
        at(f.fault_at, f"[red]{escape(f.fault)}[/] on {where}{reason} (detected after {lag})")
    at(report.ended_at, f"job {report.state}")
    return sorted(rows, key=lambda r: r[0])


def render(report: GoodputReport, console: Console | None = None) -> None:
    out = console or Console(highlight=False)
    out.print(f"[bold]{headline(report)}[/]")
    out.print(buckets_table(report))
    out.print()
    for offset, text in timeline(report):
        out.print(f"  {fmt_offset(offset):>12}  {text}")
    for note in report.notes:
        out.print(f"[dim]note: {escape(note)}[/]")
