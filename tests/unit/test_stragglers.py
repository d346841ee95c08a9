"""Persistent stragglers: pure functions over step times."""

from __future__ import annotations

import pytest

from trainpod.controller.stragglers import StragglerTracker, find_stragglers


@pytest.mark.parametrize(
    ("times", "expected"),
    [
        ({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.6}, [3]),
        ({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.5}, []),  # exactly factor x: not over it
        ({0: 1.0, 1: 3.0}, []),  # one peer: who is slow?
        ({0: 1.0, 1: 1.1, 2: 3.0}, [2]),  # two peers are enough
        ({0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0}, [2, 3]),  # the others of rank 2: 1, 1, 2
        ({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 2.0, 5: 2.0}, [4, 5]),
        ({0: 0.0, 1: 0.0, 2: 0.5}, []),  # a zero median says nothing
        ({}, []),
    ],
)
def test_find_stragglers(times: dict[int, float], expected: list[int]) -> None:
    assert find_stragglers(times) == expected


def test_find_stragglers_matches_brute_force() -> None:
    import random
    import statistics

    rng = random.Random(7)
    for _ in range(300):
        times = {
            r: rng.choice([1.0, 1.2, 2.0, rng.uniform(0.5, 3)]) for r in range(rng.randint(1, 9))
        }
        brute = [
            r
            for r, v in times.items()
            if len(times) - 1 >= 2
            and v > 1.5 * statistics.median([w for q, w in times.items() if q != r])
        ]
        assert find_stragglers(times) == sorted(brute)


def test_straggler_tracker_flags_only_persistent_stragglers() -> None:
    slow = {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0}
    ok = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
    tracker = StragglerTracker(persistent=3)
    assert tracker.update(slow) == []
    assert tracker.update(slow) == []
    assert tracker.update(ok) == []  # a blip: the streak starts again
    assert [tracker.update(slow) for _ in range(3)] == [[], [], [3]]
    assert tracker.update(slow) == [3] == tracker.flagged
    assert tracker.update(ok) == []  # recovered
    assert tracker.update({0: 1.0, 1: 1.0, 2: 1.0}) == []
    with pytest.raises(ValueError):
        StragglerTracker(persistent=0)


# -- hangs --------------------------------------------------------------------------------
