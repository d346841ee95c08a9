"""``interval="auto"``: measured stall and MTBF -> interval, its bounds, and how it adapts."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from trainpod import beacon
from trainpod.ckpt import Checkpointer
from trainpod.ckpt.errors import CheckpointConfigError
from trainpod.ckpt.interval import (
    CostMeter,
    Costs,
    IntervalBounds,
    RunningMedian,
    interval_s,
    interval_steps,
)
from trainpod.ckpt.layout import mtbf_is_prior, young_daly_s
from trainpod.testing.clock import FakeClock

WIDE = IntervalBounds(min_s=0.0, max_s=1e9)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("TRAINPOD_MTBF_S", "TRAINPOD_CKPT_SOCKET", "TRAINPOD_BEACON_SOCKET"):
        monkeypatch.delenv(var, raising=False)
    beacon.reset()
    yield
    beacon.reset()


def test_stall_and_mtbf_give_the_young_daly_interval() -> None:
    # 0.2 s stall, a fault every 2 minutes: sqrt(2 * 0.2 * 120) - 0.2 = 6.73 s.
    costs = Costs(stall_s=0.2, step_s=0.1, write_s=0.0, mtbf_s=120.0)
    assert interval_s(costs, WIDE) == pytest.approx(math.sqrt(2 * 0.2 * 120) - 0.2)
    assert interval_steps(costs, WIDE) == math.ceil((math.sqrt(48) - 0.2) / 0.1) == 68
    # A four times costlier save doubles the interval (about: Daly's - C term).
    dear = Costs(stall_s=0.8, step_s=0.1, write_s=0.0, mtbf_s=120.0)
    assert interval_s(dear, WIDE) == pytest.approx(math.sqrt(2 * 0.8 * 120) - 0.8)
    # A millisecond memory tier saves every few seconds even at a 4 h MTBF.
    cheap = Costs(stall_s=0.001, step_s=0.05, write_s=0.0, mtbf_s=4 * 3600.0)
    assert 4.0 < interval_s(cheap, IntervalBounds()) < 6.0


def test_the_interval_is_bounded_in_seconds_steps_and_by_the_memory_tier() -> None:
    bounds = IntervalBounds(min_s=2.0, max_s=600.0, min_steps=3, max_steps=500)
    tiny = Costs(stall_s=1e-6, step_s=0.01, write_s=0.0, mtbf_s=60.0)
    assert young_daly_s(1e-6, 60.0) < 0.02
    assert interval_s(tiny, bounds) == 2.0  # the floor in seconds
    assert interval_steps(tiny, bounds) == 200
    rare = Costs(stall_s=10.0, step_s=0.5, write_s=0.0, mtbf_s=1e7)
    assert interval_s(rare, bounds) == 600.0  # the ceiling: one fault costs at most 10 min
    assert interval_steps(rare, bounds) == 500  # and at most max_steps steps
    slow = Costs(stall_s=1e-6, step_s=10.0, write_s=0.0, mtbf_s=60.0)
    assert interval_steps(slow, bounds) == 3  # never more often than min_steps
    # Never faster than the memory tier commits a snapshot (the next save would block on
    # the staging buffers), even above max_s.
    busy = Costs(stall_s=1e-6, step_s=0.1, write_s=5.0, mtbf_s=60.0)
    assert interval_s(busy, bounds) == 5.0
    assert interval_s(Costs(1e-6, 0.1, 900.0, 60.0), bounds) == 900.0


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"min_s": -1.0}, "min_s"),
        ({"max_s": 0.0}, "max_s"),
        ({"min_s": 10.0, "max_s": 5.0}, "max_s"),
        ({"min_steps": 0}, "min_steps"),
        ({"min_steps": 4, "max_steps": 2}, "max_steps"),
        ({"prior_max_s": 0.0}, "prior_max_s"),
        ({"prior_overhead": 1.5}, "prior_overhead"),
    ],
)
def test_bad_bounds_are_refused_by_name(kw: dict[str, Any], named: str) -> None:
    with pytest.raises(CheckpointConfigError, match=named):
        IntervalBounds(**kw)


def test_before_the_first_fault_the_prior_mtbf_caps_the_interval() -> None:
    # The demo's case (ADR 0035): a 20 ms stall at the 4 h prior gives ~24 s between saves,
    # so the first fault redid ~100 steps of 0.15 s. While the MTBF is only the prior, at
    # most prior_max_s (5 s) of work is at stake.
    guess = Costs(stall_s=0.02, step_s=0.15, write_s=0.0, mtbf_s=4 * 3600.0, prior=True)
    seen = Costs(stall_s=0.02, step_s=0.15, write_s=0.0, mtbf_s=4 * 3600.0)
    assert interval_s(seen, IntervalBounds()) == pytest.approx(math.sqrt(2 * 0.02 * 14400) - 0.02)
    assert interval_s(guess, IntervalBounds()) == 5.0
    assert interval_steps(guess, IntervalBounds()) == 34  # ceil(5 / 0.15)
    # ... unless saving that often costs more than 1% of the loop: then stall / 1%.
    dear = Costs(stall_s=0.2, step_s=0.15, write_s=0.0, mtbf_s=4 * 3600.0, prior=True)
    assert interval_s(dear, IntervalBounds()) == pytest.approx(20.0)
    # Young/Daly shorter than the cap: the cap does not lengthen it; and it can be turned off.
    assert interval_s(replace(guess, stall_s=1e-4), IntervalBounds()) < 5.0
    assert interval_s(guess, IntervalBounds(prior_max_s=None)) == interval_s(seen, IntervalBounds())
    # The ranks agree on a prior only where the smallest MTBF is one.
    assert guess.merge(seen).prior is False and guess.merge(guess).prior is True
    observed = replace(seen, mtbf_s=60.0)
    assert guess.merge(observed) == observed.merge(guess) == replace(observed, prior=False)


def test_the_prior_is_what_no_mtbf_from_the_controller_means() -> None:
    assert mtbf_is_prior({}) and mtbf_is_prior({"TRAINPOD_MTBF_S": "junk"})
    assert mtbf_is_prior({"TRAINPOD_MTBF_S": "0"})
    assert not mtbf_is_prior({"TRAINPOD_MTBF_S": "55"})


def test_the_ranks_agree_on_the_slowest_costs_and_the_smallest_mtbf() -> None:
    a = Costs(stall_s=0.1, step_s=0.5, write_s=2.0, mtbf_s=300.0)
    b = Costs(stall_s=0.3, step_s=0.4, write_s=1.0, mtbf_s=900.0)
    assert a.merge(b) == b.merge(a) == Costs(0.3, 0.5, 2.0, 300.0)


def test_the_meter_times_steps_by_its_clock_and_leaves_saves_out() -> None:
    clock = FakeClock()
    meter = CostMeter(clock)
    assert meter.costs(60.0) is None  # nothing measured yet
    for step in range(1, 6):
        clock.advance(0.5)
        meter.step(step)
    clock.advance(3.0)  # a save that took 3 s, right after step 5
    meter.saved(3.0)
    clock.advance(0.5)
    meter.step(6)
    costs = meter.costs(60.0)
    assert costs is not None
    assert costs.step_s == 0.5 and costs.stall_s == 3.0 and costs.write_s == 0.0
    meter.restart()  # a load: the gap before the next step is not a step
    clock.advance(100.0)
    meter.step(40)
    assert meter.steps.value() == 0.5


def test_the_interval_follows_the_stall_median_as_it_changes() -> None:
    clock = FakeClock()
    meter = CostMeter(clock, window=9)
    for step in range(1, 4):
        clock.advance(0.5)
        meter.step(step)

    def steps_now() -> int:
        costs = meter.costs(120.0)
        assert costs is not None
        return interval_steps(costs, WIDE)

    for _ in range(9):
        meter.saved(0.01)
    cheap = steps_now()
    assert cheap == math.ceil((math.sqrt(2 * 0.01 * 120) - 0.01) / 0.5)
    meter.saved(5.0)  # one slow save does not move the cadence
    assert steps_now() == cheap
    for _ in range(3):
        meter.saved(0.5)
    assert steps_now() == cheap  # 4 of 9 samples are slow: the median is still 0.01
    meter.saved(0.5)
    assert steps_now() == math.ceil((math.sqrt(2 * 0.5 * 120) - 0.5) / 0.5)  # 5 of 9: 0.5


def test_running_median() -> None:
    m = RunningMedian(3)
    assert m.value() is None
    for v in (1.0, 9.0, 2.0, 3.0):
        m.add(v)
    assert m.value() == 3.0  # of 9, 2, 3
    with pytest.raises(ValueError, match="window"):
        RunningMedian(0)


def _state() -> dict[str, Any]:
    return {"t": torch.arange(64.0), "n": 1}


def _run(ck: Checkpointer, clock: FakeClock, steps: range) -> list[int]:
    """A training loop of 1 s steps on the fake clock; the steps saved."""
    saved = []
    for step in steps:
        clock.advance(1.0)
        if ck.due(step):
            ck.save(step, _state())
            assert ck.wait(30)  # the next save reads what the ranks agreed on this one
            saved.append(step)
    return saved


def test_a_checkpointer_saves_at_the_bounded_interval_and_follows_the_mtbf(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    mtbf = {"s": 1e9}
    ck = Checkpointer(
        dir=tmp_path / "durable",
        memory=tmp_path / "shm",
        interval="auto",
        mtbf_s=lambda: mtbf["s"],
        bounds=IntervalBounds(min_s=20.0, max_s=50.0),
        clock=clock,
    )
    with ck:
        # Two warm-up saves 5 timed steps apart; from then on the interval is what the
        # ranks agreed at the save before: Young/Daly at an MTBF of 1e9 s is far above
        # max_s, so every 50 steps.
        saved = _run(ck, clock, range(1, 120))
        assert saved == [6, 11, 61, 111]
        assert ck.costs is not None and ck.costs.step_s == 1.0 and ck.costs.mtbf_s == 1e9
        assert ck.interval_steps == 50 and ck.interval_s() == 50.0
        # Faults become frequent: Young/Daly falls below min_s, so every 20 steps. The MTBF
        # is read at each save (161: due by what step 61 agreed), agreed on with it, and
        # counts from the save after (211: due by what 111 agreed).
        mtbf["s"] = 1e-3
        saved = _run(ck, clock, range(120, 300))
        assert saved == [161, 211, 231, 251, 271, 291]
        assert ck.interval_steps == 20 and ck.interval_s() == 20.0


def test_a_checkpointer_refuses_a_bad_mtbf(tmp_path: Path) -> None:
    with pytest.raises(CheckpointConfigError, match="mtbf_s"):
        Checkpointer(dir=tmp_path, memory=tmp_path / "shm", interval="auto", mtbf_s=0.0)
