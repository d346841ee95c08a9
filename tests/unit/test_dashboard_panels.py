"""What the dashboard's pages show, from the API's models (pure functions)."""

from __future__ import annotations

from trainpod.api.models import EventInfo
from trainpod.dashboard.panels import checkpoint_tiers, size, timeline


def event(i: int, kind: str, node: str | None = None, **data: object) -> EventInfo:
    return EventInfo(id=i, ts=100.0 + i, kind=kind, node=node, job_id=1, attempt=1, data=data)


def test_checkpoint_tiers_in_tier_order_with_the_newest_step_and_the_last_failure() -> None:
    evs = [
        event(1, "checkpoint_saved", tier="memory", step=10, bytes=100, stall_s=0.1, at=1.0),
        event(2, "checkpoint_committed", "n0", tier="scratch", step=10, bytes=100, at=1.0),
        event(3, "checkpoint_committed", tier="durable", step=10, bytes=300, at=1.0),
        event(4, "checkpoint_saved", tier="memory", step=20, bytes=200, stall_s=0.1, at=2.0),
        event(5, "checkpoint_failed", "n0", tier="durable", step=20, reason="bucket gone"),
        event(6, "job_state", old="queued", new="starting"),
    ]
    rows = checkpoint_tiers(evs)
    assert [(r.tier, r.last_step, r.commits, r.last_bytes, r.failures) for r in rows] == [
        ("memory", 20, 2, 200, 0),
        ("scratch", 10, 1, 100, 0),
        ("durable", 10, 1, 300, 1),
    ]
    assert rows[2].last_failure == "step 20 on n0: bucket gone"


def test_the_timeline_is_newest_first_bounded_and_without_log_tails() -> None:
    evs = [event(i, "rank_exited", "n0", rank=0, log_tail="x" * 50, exit_code=1) for i in range(5)]
    rows = timeline(evs, limit=3)
    assert [r["id"] for r in rows] == [4, 3, 2]
    assert "log_tail" not in rows[0]["data"] and "exit_code=1" in rows[0]["data"]


def test_sizes_read_as_people_write_them() -> None:
    assert [size(x) for x in (None, 0, 500, 7905, 3 * 2**20, 5 * 2**40)] == [
        "-",
        "-",
        "500 B",
        "7.7 KiB",
        "3.0 MiB",
        "5.0 TiB",
    ]
