"""Decayed usage: the exact integral of nodes * 2^(-(now - t) / half-life) over each interval."""

from __future__ import annotations

import random

import pytest

from trainpod.scheduler.usage import UsageInterval, decayed_usage

DAY = 86400.0
SEEDS = range(40)


def random_intervals(rng: random.Random, now: float) -> list[UsageInterval]:
    out = []
    for _ in range(rng.randint(1, 6)):
        start = rng.uniform(now - 30 * DAY, now)
        end = rng.choice([None, rng.uniform(start, now)])
        out.append(UsageInterval(rng.choice("ab"), rng.randint(0, 16), start, end))
    return out


def test_use_right_now_is_worth_its_node_seconds() -> None:
    # one node for one second ending now: almost exactly one node-second
    got = decayed_usage([UsageInterval("a", 1, 99.0, 100.0)], 100.0, 7 * DAY)
    assert got["a"] == pytest.approx(1.0, rel=1e-5)


def test_use_one_half_life_ago_is_worth_half() -> None:
    h = 1000.0
    got = decayed_usage([UsageInterval("a", 4, 0.0, 1.0)], 1.0 + h, h)
    assert got["a"] == pytest.approx(4 * 0.5, rel=1e-3)


@pytest.mark.parametrize("seed", SEEDS)
def test_it_halves_after_one_half_life_with_no_new_use(seed: int) -> None:
    rng = random.Random(seed)
    now, h = 100 * DAY, rng.uniform(DAY, 14 * DAY)
    ended = [
        UsageInterval(iv.team, iv.nodes, iv.start, now if iv.end is None else iv.end)
        for iv in random_intervals(rng, now)
    ]
    before = decayed_usage(ended, now, h)
    after = decayed_usage(ended, now + h, h)
    for team, value in before.items():
        assert after[team] == pytest.approx(value / 2, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_it_is_additive_over_split_intervals(seed: int) -> None:
    rng = random.Random(seed)
    now, h = 50 * DAY, rng.uniform(DAY, 14 * DAY)
    start = rng.uniform(0, now)
    end = rng.uniform(start, now)
    mid = rng.uniform(start, end)
    nodes = rng.randint(1, 64)
    whole = decayed_usage([UsageInterval("a", nodes, start, end)], now, h)
    parts = decayed_usage(
        [UsageInterval("a", nodes, start, mid), UsageInterval("a", nodes, mid, end)], now, h
    )
    assert parts["a"] == pytest.approx(whole["a"], rel=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_it_lies_between_the_decayed_ends_and_the_raw_node_seconds(seed: int) -> None:
    rng = random.Random(seed)
    now, h = 40 * DAY, rng.uniform(DAY, 14 * DAY)
    for iv in random_intervals(rng, now):
        end = now if iv.end is None else iv.end
        got = decayed_usage([iv], now, h)[iv.team]
        raw = iv.nodes * (end - iv.start)
        assert raw * 2 ** (-(now - iv.start) / h) - 1e-6 <= got <= raw + 1e-6


def test_a_running_interval_counts_up_to_now_and_the_future_not_at_all() -> None:
    h = 3600.0
    running = decayed_usage([UsageInterval("a", 2, 0.0, None)], 100.0, h)
    ended = decayed_usage([UsageInterval("a", 2, 0.0, 100.0)], 100.0, h)
    later = decayed_usage([UsageInterval("a", 2, 0.0, 500.0)], 100.0, h)
    assert running == ended == later
    assert decayed_usage([UsageInterval("a", 2, 200.0, 300.0)], 100.0, h) == {"a": 0.0}


def test_teams_are_summed_separately() -> None:
    got = decayed_usage(
        [UsageInterval("a", 1, 0, 10), UsageInterval("b", 3, 0, 10), UsageInterval("a", 1, 0, 10)],
        10.0,
        1e9,
    )
    assert got["a"] == pytest.approx(20.0, rel=1e-6)
    assert got["b"] == pytest.approx(30.0, rel=1e-6)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="half-life above 0"):
        decayed_usage([], 0.0, 0.0)
    with pytest.raises(ValueError, match="bad usage interval"):
        decayed_usage([UsageInterval("a", 1, 10.0, 5.0)], 20.0, 100.0)
    with pytest.raises(ValueError, match="bad usage interval"):
        decayed_usage([UsageInterval("a", -1, 0.0, 5.0)], 20.0, 100.0)
