"""Reading progress beacons on the controller: hangs, stragglers, per-attempt summaries.

Beacons reach the controller as per-rank summaries inside agents' heartbeats; each is kept
with the controller time it arrived, so ages are measured as "age at the agent + time since
that heartbeat" and no two clocks are ever compared.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from trainpod.api.models import RankBeacon
from trainpod.controller.stragglers import StragglerTracker

Book = Mapping[int, tuple[RankBeacon, float]]  # rank -> (latest summary, received at)


def hang(
    beacons: Book,
    *,
    now: float,
    started_at: float,
    hang_timeout_s: float,
    startup_timeout_s: float | None,
) -> tuple[str, float, int | None] | None:
    """(reason, when the job stopped progressing, the silent rank) if hung, else None.

    Before any rank has sent a beacon, only ``startup_timeout_s`` applies (a job that never
    uses beacons is never called hung). After that, the rank whose last beacon is oldest
    decides: one stopped rank stalls every collective, so it is the whole job's hang. Ranks
    that never report are not judged: many jobs report from rank 0 only.
    """
    if not beacons:
        if startup_timeout_s is not None and now - started_at > startup_timeout_s:
            return (
                f"no progress beacon within the startup timeout of {startup_timeout_s:g}s",
                started_at,
                None,
            )
        return None
    ages = {r: b.age_s + (now - received) for r, (b, received) in beacons.items()}
    rank, age = max(ages.items(), key=lambda kv: kv[1])
    if age > hang_timeout_s:
        b = beacons[rank][0]
        return (
            f"rank {rank} sent no progress beacon for {age:.1f}s (last step {b.last_step}, "
            f"hang_timeout {hang_timeout_s:g}s)",
            now - age,
            rank,
        )
    return None


def group_lost(beacons: Book, *, generation: int, now: float) -> tuple[str, float, None] | None:
    """(reason, when the job stopped progressing, None) if a rank of an in-process job said
    it lost generation ``generation``'s process group (a collective failed or timed out:
    ``lost_generation`` in its beacons) and waits for the next, else None. Its peers may have
    said nothing, being stuck: the rung tells them apart (:func:`rung.decide_hang`)."""
    waiting = sorted(
        r
        for r, (b, _) in beacons.items()
        if b.lost_generation is not None and b.lost_generation >= generation
    )
    if not waiting:
        return None
    oldest = max(b.age_s + (now - received) for b, received in beacons.values())
    names = ", ".join(map(str, waiting))
    return (
        f"rank {names} lost its process group of generation {generation} (a collective "
        "failed or timed out)",
        now - oldest,
        None,
    )


def stragglers(
    trackers: dict[int, tuple[StragglerTracker, float]],
    attempt_id: int,
    beacons: Book,
    *,
    factor: float,
    checks: int,
) -> list[int]:
    """Ranks newly flagged as persistent stragglers; evaluated once per fresh report."""
    if not beacons:
        return []
    latest = max(received for _, received in beacons.values())
    tracker, seen = trackers.get(attempt_id, (None, -1.0))
    if tracker is None:
        tracker = StragglerTracker(factor=factor, persistent=checks)
    if latest <= seen:
        return []
    before = set(tracker.flagged)
    times = {r: b.step_time_s for r, (b, _) in beacons.items() if b.step_time_s}
    after = tracker.update(times)
    trackers[attempt_id] = (tracker, latest)
    return [r for r in after if r not in before]


def summarise(beacons: Book) -> dict[str, Any]:
    """One attempt's progress, for the ``attempt_progress`` event (goodput reads it)."""
    if not beacons:
        return {}
    bs = [b for b, _ in beacons.values()]
    last_steps = [b.last_step for b in bs if b.last_step is not None]
    first_steps = [b.first_step for b in bs if b.first_step is not None]
    times = [b.step_time_s for b in bs if b.step_time_s]
    ckpts = [b.last_checkpoint_step for b in bs if b.last_checkpoint_step is not None]
    return {
        "first_step": min(first_steps) if first_steps else None,
        "last_step": min(last_steps) if last_steps else None,  # the step every rank finished
        "first_beacon_at": min(b.first_at for b in bs),
        "last_beacon_at": max(b.last_at for b in bs),
        "step_time_s": statistics.median(times) if times else None,
        "steps": max(b.steps for b in bs),
        "last_checkpoint_step": max(ckpts) if ckpts else None,
        "checkpoint_stall_s": max(b.checkpoint_stall_s for b in bs),
        "ranks": len(bs),
    }
