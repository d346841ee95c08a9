"""What ``trainpod show`` says of a job's checkpoints, from its events: the newest step each
tier committed, the saves a full tier sent elsewhere (ADR 0036) and the saves that failed,
each grouped by tier and node so that a job that met a full ``/dev/shm`` on every save reads
as one line, not hundreds."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from trainpod.api.models import EventInfo

TIERS = ("memory", "scratch", "peer", "durable")


@dataclass
class _Group:
    steps: list[int] = field(default_factory=list)
    last_reason: str = ""


def _steps(steps: list[int]) -> str:
    lo, hi = min(steps), max(steps)
    n = len(steps)
    return f"step {lo}" if n == 1 else f"{n} steps ({lo}-{hi})"


def checkpoint_lines(events: Iterable[EventInfo]) -> list[str]:
    """Lines for ``trainpod show`` (each starts with its label); none for a job that never
    saved."""
    committed: dict[str, int] = {}
    full: dict[tuple[str, str, str | None], _Group] = {}
    failed: dict[tuple[str, str], _Group] = {}
    for e in events:
        d = e.data
        node = str(e.node or d.get("node"))  # the event's node column holds it
        if e.kind in ("checkpoint_saved", "checkpoint_committed"):
            tier = str(d.get("tier", "?"))
            committed[tier] = max(committed.get(tier, -1), int(d.get("step", -1)))
        elif e.kind == "checkpoint_tier_full":
            g = full.setdefault((str(d.get("tier")), node, d.get("to")), _Group())
            g.steps.append(int(d.get("step", -1)))
            g.last_reason = str(d.get("reason", ""))
        elif e.kind == "checkpoint_failed":
            g = failed.setdefault((str(d.get("tier")), node), _Group())
            g.steps.append(int(d.get("step", -1)))
            g.last_reason = str(d.get("reason", ""))
    lines = []
    if committed:
        order = sorted(committed, key=lambda t: (TIERS.index(t) if t in TIERS else len(TIERS), t))
        lines.append(
            "checkpoints  newest step by tier: " + ", ".join(f"{t} {committed[t]}" for t in order)
        )
    for (tier, node, to), g in sorted(full.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        where = f"went to {to}" if to else "found no node-local tier"
        lines.append(f"tier full    {tier} on {node}: {_steps(g.steps)} {where} ({g.last_reason})")
    for (tier, node), g in sorted(failed.items()):
        lines.append(f"save failed  {tier} on {node}: {_steps(g.steps)}, last: {g.last_reason}")
    return lines
