"""ByteBoundedCache: the newest entries kept, their sizes summed to at most the bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainpod.api.heartbeat import reply_bytes_for
from trainpod.api.models import sealed_bytes_for
from trainpod.bounded import ByteBoundedCache


def test_the_oldest_go_first_once_the_bytes_are_over() -> None:
    c: ByteBoundedCache[int, str] = ByteBoundedCache(10)
    for k in range(4):
        c.put(k, f"v{k}", 3)
    assert (0 in c, c.get(1), c.get(3), c.bytes, c.evicted) == (False, "v1", "v3", 9, 1)
    c.put(9, "big", 7)  # 1 and 2 make room
    assert [k for k in range(10) if k in c] == [3, 9] and c.bytes == 10 and c.evicted == 3


def test_a_replaced_value_counts_once_and_becomes_the_newest() -> None:
    c: ByteBoundedCache[str, int] = ByteBoundedCache(10)
    c.put("a", 1, 4)
    c.put("b", 2, 4)
    c.put("a", 3, 5)  # replaces a (4 -> 5): 9 bytes, a now newest
    assert (c.get("a"), c.bytes, c.evicted) == (3, 9, 0)
    c.put("c", 4, 2)  # b, the oldest, goes
    assert ("b" in c, c.get("a"), c.get("c"), c.bytes) == (False, 3, 4, 7)


def test_a_value_larger_than_the_bound_is_not_kept() -> None:
    c: ByteBoundedCache[int, str] = ByteBoundedCache(10)
    c.put(1, "x", 2)
    c.put(1, "huge", 11)
    assert (1 in c, len(c), c.bytes) == (False, 0, 0)


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_bytes must be at least 0"):
        ByteBoundedCache(-1)


@settings(deadline=None)
@given(
    st.integers(0, 50),
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 30)), max_size=60),
)
def test_kept_entries_are_the_newest_that_fit(bound: int, puts: list[tuple[int, int]]) -> None:
    c: ByteBoundedCache[int, int] = ByteBoundedCache(bound)
    for i, (key, size) in enumerate(puts):
        c.put(key, i, size)
    latest: dict[int, tuple[int, int]] = {}  # key -> (its last put's index, size)
    for i, (key, size) in enumerate(puts):
        latest.pop(key, None)
        latest[key] = (i, size)
    kept = {k for k in latest if k in c}
    assert c.bytes == sum(latest[k][1] for k in kept) <= bound
    for k in kept:
        assert c.get(k) == latest[k][0]  # the value of its last put
    # whatever was kept, every newer key that fits was kept too (eviction is oldest first)
    order = sorted(latest, key=lambda k: latest[k][0])
    first_kept = next((i for i, k in enumerate(order) if k in kept), len(order))
    assert all(k in kept or latest[k][1] > bound for k in order[first_kept:])


def test_a_smaller_bound_lets_the_oldest_go_at_once() -> None:
    c: ByteBoundedCache[str, int] = ByteBoundedCache(30)
    for i, key in enumerate("abc"):
        c.put(key, i, 10)
    c.resize(15)
    assert (list(k for k in "abc" if k in c), c.bytes, c.evicted) == (["c"], 10, 2)
    c.resize(100)
    c.put("d", 3, 60)
    assert "c" in c and "d" in c
    with pytest.raises(ValueError, match="at least 0"):
        c.resize(-1)


@pytest.mark.parametrize(
    ("nodes", "sealed", "replies"),
    [
        (1, 2 << 20, 1 << 20),
        (2, 2 << 20, 1 << 20),
        (256, 8 << 20, 4 << 20),
        (1024, 32 << 20, 16 << 20),
        (10_000, 32 << 20, 16 << 20),
    ],
)
def test_the_orders_caches_follow_the_cluster_s_size(nodes: int, sealed: int, replies: int) -> None:
    assert sealed_bytes_for(nodes) == sealed
    assert reply_bytes_for(nodes) == replies
