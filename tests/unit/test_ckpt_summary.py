"""``trainpod show``'s checkpoint lines (trainpod.cli.ckptsummary), from events."""

from __future__ import annotations

from typing import Any

from trainpod.api.models import EventInfo
from trainpod.cli.ckptsummary import checkpoint_lines


def _event(i: int, kind: str, node: str | None = None, **data: Any) -> EventInfo:
    """As the API gives it: the node in the event's own column, not in ``data``."""
    return EventInfo(id=i, ts=float(i), kind=kind, node=node, job_id=1, attempt=1, data=data)


def test_a_job_that_never_saved_has_no_checkpoint_lines() -> None:
    assert checkpoint_lines([_event(1, "job_submitted")]) == []


def test_newest_step_by_tier_full_tiers_and_failures_each_grouped() -> None:
    full = "ENOSPC: No space left on device (needed 2097152 bytes, 1048576 free)"
    events = [
        _event(
            1,
            "checkpoint_tier_full",
            node="workers-0",
            step=0,
            tier="memory",
            to="scratch",
            reason=full,
        ),
        _event(2, "checkpoint_saved", step=0, tier="scratch"),
        _event(
            3,
            "checkpoint_tier_full",
            node="workers-0",
            step=1,
            tier="memory",
            to="scratch",
            reason=full,
        ),
        _event(4, "checkpoint_saved", step=1, tier="scratch"),
        _event(5, "checkpoint_committed", node=None, step=1, tier="durable"),
        _event(6, "checkpoint_committed", node="workers-0", step=0, tier="durable"),
        _event(
            7,
            "checkpoint_tier_full",
            node="workers-1",
            step=4,
            tier="memory",
            to=None,
            reason="ENOSPC everywhere",
        ),
        _event(8, "checkpoint_failed", node="workers-1", step=4, tier="peer", reason="refused"),
    ]
    assert checkpoint_lines(events) == [
        "checkpoints  newest step by tier: scratch 1, durable 1",
        f"tier full    memory on workers-0: 2 steps (0-1) went to scratch ({full})",
        "tier full    memory on workers-1: step 4 found no node-local tier (ENOSPC everywhere)",
        "save failed  peer on workers-1: step 4, last: refused",
    ]
