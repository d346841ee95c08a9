"""FIFO gang placement: a pure function from (queue, free nodes) to placements."""

from __future__ import annotations

from collections.abc import Sequence

from trainpod.scheduler.base import QueuedJob
from trainpod.scheduler.fifo import FreeNode, Placement, place

A = frozenset({"a"})
B = frozenset({"b"})
AB = frozenset({"a", "b"})


def free(*names: str) -> list[FreeNode]:
    """Free nodes named ``<group>-<i>``."""
    return [FreeNode(n, n.split("-")[0]) for n in names]


def job(id: int, nodes: int, groups: frozenset[str] = A) -> QueuedJob:
    return QueuedJob(id=id, nodes=nodes, groups=groups)


def placed(queue: Sequence[QueuedJob], nodes: Sequence[FreeNode]) -> dict[int, tuple[str, ...]]:
    return {p.job_id: p.nodes for p in place(queue, nodes)}


def test_nothing_to_place() -> None:
    assert place([], free("a-0")) == []
    assert place([job(1, 1)], []) == []


def test_a_gang_gets_all_its_nodes_at_once_in_free_order() -> None:
    assert place([job(1, 2)], free("a-2", "a-0", "a-1")) == [Placement(1, ("a-2", "a-0"))]


def test_a_gang_that_does_not_fit_gets_nothing() -> None:
    assert place([job(1, 3)], free("a-0", "a-1")) == []


def test_jobs_are_placed_in_queue_order_on_distinct_nodes() -> None:
    out = place([job(1, 1), job(2, 2), job(3, 1)], free("a-0", "a-1", "a-2", "a-3"))
    assert out == [
        Placement(1, ("a-0",)),
        Placement(2, ("a-1", "a-2")),
        Placement(3, ("a-3",)),
    ]


def test_head_of_line_blocking_no_backfill_in_the_partition() -> None:
    # job 1 waits for 3 nodes; job 2 would fit but must not jump the queue
    assert place([job(1, 3), job(2, 1)], free("a-0", "a-1")) == []


def test_the_third_job_waits_until_nodes_free() -> None:
    queue = [job(1, 2), job(2, 2), job(3, 2)]
    assert placed(queue, free("a-0", "a-1", "a-2", "a-3")) == {
        1: ("a-0", "a-1"),
        2: ("a-2", "a-3"),
    }
    assert placed([job(3, 2)], free("a-0", "a-1")) == {3: ("a-0", "a-1")}


def test_partitions_are_independent() -> None:
    # job 1 blocks partition a; job 2 on partition b still runs, job 3 on a still waits
    queue = [job(1, 3, A), job(2, 1, B), job(3, 1, A)]
    assert placed(queue, free("a-0", "a-1", "b-0")) == {2: ("b-0",)}


def test_a_job_only_gets_nodes_of_its_partition_groups() -> None:
    assert placed([job(1, 2, B)], free("a-0", "a-1", "b-0")) == {}
    assert placed([job(1, 2, AB)], free("a-0", "b-0")) == {1: ("a-0", "b-0")}


def test_blocking_spreads_over_overlapping_partitions() -> None:
    # job 1 (a+b) waits: it blocks a and b, so job 2 (b) waits too, but c is free to go
    queue = [job(1, 4, AB), job(2, 1, B), job(3, 1, frozenset({"c"}))]
    assert placed(queue, free("a-0", "b-0", "c-0")) == {3: ("c-0",)}


def test_a_blocked_job_blocks_later_jobs_sharing_any_of_its_groups() -> None:
    # job 2 (b) is blocked behind job 1 (b); job 3 (a+b) shares b, so it waits too
    queue = [job(1, 2, B), job(2, 1, A), job(3, 1, AB)]
    assert placed(queue, free("a-0", "a-1", "b-0")) == {2: ("a-0",)}


def test_place_only_hands_out_the_free_nodes_it_is_given() -> None:
    # spares are the controller's business: it never lists them as free, so nothing here
    # can place on them; place() itself has no notion of a spare
    queue = [job(1, 1), job(2, 1)]
    assert placed(queue, free("a-1")) == {1: ("a-1",)}


def test_place_is_pure() -> None:
    queue = [job(1, 1), job(2, 1)]
    nodes = free("a-0", "a-1")
    first = place(queue, nodes)
    assert place(queue, nodes) == first
    assert nodes == free("a-0", "a-1")
