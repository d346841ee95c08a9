"""The controller's bounded progress history (the dashboard's curves)."""

from __future__ import annotations

from trainpod.api.models import RankBeacon
from trainpod.controller.history import KEPT_JOBS, KEPT_POINTS, ProgressHistory


def beacon(rank: int, step: int, **metrics: object) -> RankBeacon:
    return RankBeacon(
        rank=rank,
        first_at=0.0,
        last_at=float(step),
        age_s=0.0,
        last_step=step,
        steps=step,
        step_time_s=0.5,
        metrics=dict(metrics),
    )


def test_a_point_per_moved_step_with_the_lowest_ranks_step_and_rank_zeros_loss() -> None:
    h = ProgressHistory()
    h.add(1, 1, [beacon(1, 5, loss=9.0), beacon(0, 4, loss=2.5)], now=10.0)
    h.add(1, 1, [beacon(0, 4, loss=2.5)], now=11.0)  # the same step: no new point
    h.add(1, 1, [beacon(0, 6, loss=2.0, tokens_total=600)], now=12.0)
    h.add(1, 2, [beacon(0, 6, loss=2.1)], now=13.0)  # a restart repeats a step: kept
    points = h.of(1)
    assert [(p.attempt, p.step, p.loss, p.t) for p in points] == [
        (1, 4, 2.5, 10.0),
        (1, 6, 2.0, 12.0),
        (2, 6, 2.1, 13.0),
    ]
    assert points[1].tokens_total == 600.0 and points[0].step_time_s == 0.5
    h.add(1, 2, [beacon(0, 7, loss="nan?")], now=14.0)  # not a number: no loss
    assert h.of(1)[-1].loss is None
    h.add(2, 1, [RankBeacon(rank=0, first_at=0, last_at=0, age_s=0)], now=1.0)
    assert h.of(2) == []  # no step yet


def test_the_ring_is_bounded_and_an_ended_job_keeps_a_thinned_copy() -> None:
    h = ProgressHistory(ring=1_000)
    for step in range(1, 2_501):
        h.add(7, 1, [beacon(0, step)], now=float(step))
    assert len(h.of(7)) == 1_000 and h.of(7)[0].step == 1_501
    h.keep_only({8})  # job 7 ended
    kept = h.of(7)
    assert h.live_jobs() == 0
    assert len(kept) <= KEPT_POINTS and kept[0].step == 1_501 and kept[-1].step == 2_500
    assert [p.step for p in kept] == sorted(p.step for p in kept)


def test_only_the_newest_ended_jobs_are_kept() -> None:
    h = ProgressHistory()
    for job in range(KEPT_JOBS + 5):
        h.add(job, 1, [beacon(0, 1)], now=1.0)
        h.keep_only(set())
    assert h.of(0) == [] and h.of(4) == []
    assert h.of(5) != [] and h.of(KEPT_JOBS + 4) != []
