"""The scheduling benchmark's trace generator and metric functions, on hand-made inputs
(no Slurm, no cluster: ``benchmarks/schedulingkit.py`` is pure)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from benchmarks.schedulingkit import (
    PARAMS,
    Attempt,
    JobOutcome,
    TraceJob,
    all_waiting_windows,
    handover_gaps,
    idle_while_waiting,
    jain,
    make_trace,
    offered_load,
    parse_log,
    preemptions,
    replay_metrics,
    reruns_after_done,
    stats,
    utilisation_while_waiting,
    waiting_intervals,
    within_target,
)


def test_the_trace_is_deterministic_and_follows_its_parameters() -> None:
    a, b = make_trace(PARAMS), make_trace(PARAMS)
    assert a == b
    assert len(a) == PARAMS.jobs
    assert a != make_trace(replace(PARAMS, seed=PARAMS.seed + 1))
    arrivals = [j.arrival_s for j in a]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] == 0.0
    assert PARAMS.arrival_s * 0.95 < arrivals[-1] <= PARAMS.arrival_s
    sizes = {n for n, _ in PARAMS.size_mix}
    assert {j.nodes for j in a} <= sizes
    assert {j.priority_class for j in a} == {c for c, _ in PARAMS.class_mix}
    assert {j.team for j in a} == set(PARAMS.teams)
    assert all(j.user == f"{j.team}-user" for j in a)
    lo, hi = PARAMS.length_min_s / PARAMS.step_s, PARAMS.length_max_s / PARAMS.step_s
    assert all(round(lo) <= j.steps <= round(hi) for j in a)
    assert 1.0 < offered_load(a, PARAMS) < 1.5  # work waits, and the run stays short


def test_time_limits_cover_the_length_in_slurm_format() -> None:
    for j in make_trace(PARAMS):
        minutes, seconds = j.time_limit.split(":")
        limit = int(minutes) * 60 + int(seconds)
        assert 0 <= int(seconds) < 60
        assert limit >= j.steps * PARAMS.step_s * PARAMS.time_factor + PARAMS.time_slack_s


def test_the_class_and_size_mix_shows_in_a_large_trace() -> None:
    jobs = make_trace(replace(PARAMS, jobs=5000))
    share = sum(j.priority_class == "high" for j in jobs) / len(jobs)
    assert share == pytest.approx(dict(PARAMS.class_mix)["high"], abs=0.02)
    ones = sum(j.nodes == 1 for j in jobs) / len(jobs)
    assert ones == pytest.approx(dict(PARAMS.size_mix)[1], abs=0.03)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"jobs": 0}, "jobs must be >= 1"),
        ({"size_mix": ((7, 1.0),)}, "outside 1..nodes"),
        ({"class_mix": (("urgent", 1.0),)}, "class_mix names 'urgent'"),
        ({"step_s": 0.0}, "step_s > 0"),
    ],
)
def test_bad_parameters_are_named(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_trace(replace(PARAMS, **change))  # type: ignore[arg-type]


def test_jain_index() -> None:
    assert jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain([3.0, 1.0]) == pytest.approx(16 / 20)
    assert math.isnan(jain([]))
    with pytest.raises(ValueError, match="non-negative"):
        jain([1.0, -1.0])


def test_percentiles_and_stats() -> None:
    s = stats([1.0, 2.0, 3.0, 4.0, 5.0, float("nan")])
    assert s["n"] == 5
    assert s["mean"] == pytest.approx(3.0)
    assert s["p50"] == pytest.approx(3.0)
    assert s["p95"] == pytest.approx(4.8)
    assert s["max"] == 5.0
    assert math.isnan(stats([])["p95"])


def test_utilisation_counts_only_while_work_waits() -> None:
    # 4 nodes; from 0-10 two busy, 10-20 four busy; a job waits during 5-15 only.
    busy = [(0.0, 20.0, 2.0), (10.0, 20.0, 2.0)]
    waiting = [(5.0, 15.0, 1.0)]
    # while waiting: 5 s at 2/4, 5 s at 4/4 -> 0.75
    assert utilisation_while_waiting(busy, waiting, 4) == pytest.approx(0.75)
    # two jobs waiting at once count that time once
    both = [(5.0, 15.0, 1.0), (5.0, 10.0, 1.0)]
    assert utilisation_while_waiting(busy, both, 4) == pytest.approx(0.75)
    assert math.isnan(utilisation_while_waiting(busy, [], 4))
    # more busy than capacity (a late line) is capped
    assert utilisation_while_waiting([(0.0, 10.0, 9.0)], [(0.0, 10.0, 1.0)], 4) == 1.0
    with pytest.raises(ValueError, match="capacity"):
        utilisation_while_waiting(busy, waiting, 0)


def test_idle_while_waiting_splits_by_whether_a_waiting_job_fits() -> None:
    # 4 nodes, 2 busy 0-10, 3 busy 10-20; a 2-node job waits 0-20, a 1-node job 10-20.
    busy = [(0.0, 20.0, 2.0), (10.0, 20.0, 1.0)]
    waiting = [(0.0, 20.0, 2.0), (10.0, 20.0, 1.0)]
    fit, nofit = idle_while_waiting(busy, waiting, 4)
    # 0-10: 2 idle, the 2-node job fits; 10-20: 1 idle, the 1-node job fits
    assert fit == pytest.approx(30 / 80)
    assert nofit == 0.0
    fit, nofit = idle_while_waiting(busy, [(0.0, 20.0, 3.0)], 4)
    assert fit == 0.0
    assert nofit == pytest.approx(30 / 80)  # the 3-node job never fits
    assert math.isnan(idle_while_waiting(busy, [], 4)[0])
    # idle + busy = capacity while waiting
    util = utilisation_while_waiting(busy, [(0.0, 20.0, 1.0)], 4)
    assert util + sum(idle_while_waiting(busy, [(0.0, 20.0, 3.0)], 4)) == pytest.approx(1.0)


def test_handover_gaps_per_node() -> None:
    a = JobOutcome(_job(0, nodes=2), 0.0, [Attempt(0.0, 0, ("node1", "node2"), last_t=5.0)])
    b = JobOutcome(_job(1), 0.0, [Attempt(5.5, 0, ("node1",), last_t=9.0)])
    c = JobOutcome(_job(2), 0.0, [Attempt(30.0, 0, ("node2",), last_t=31.0)])  # idle, no work
    assert handover_gaps([a, b, c]) == [pytest.approx(0.5)]


def test_windows_when_every_team_waits() -> None:
    per_team = [[(0.0, 10.0, 1.0)], [(5.0, 20.0, 1.0), (25.0, 30.0, 1.0)]]
    assert all_waiting_windows(per_team) == [(5.0, 10.0)]
    assert all_waiting_windows([[(0.0, 4.0, 1.0)], [(4.0, 8.0, 1.0)]]) == []


def _job(index: int, cls: str = "low", team: str = "vision", nodes: int = 1) -> TraceJob:
    return TraceJob(index, 0.0, team, f"{team}-user", cls, nodes, 10, "0:20")


LOG = """\
kind=start t=100.0 step=0 nodes=node1
kind=step t=101.0 step=1 nodes=node1
kind=step t=102.0 step=2 nodes=node1
kind=step t=103.0 step=3 nodes=node1
kind=notice t=103.5 step=3 nodes=node1
kind=saved t=103.6 step=3 nodes=node1
kind=start t=110.0 step=3 nodes=node2
kind=step t=111.0 step=4 nodes=node2
kind=done t=111.0 step=4 nodes=node2
"""


def test_parse_log_splits_attempts() -> None:
    a, b = parse_log(LOG.splitlines())
    assert (a.started_t, a.resumed_step, a.nodes) == (100.0, 0, ("node1",))
    assert a.steps == [(1, 101.0), (2, 102.0), (3, 103.0)]
    assert (a.notice_t, a.saved_step, a.done, a.last_t) == (103.5, 3, False, 103.6)
    assert (b.resumed_step, b.done, b.nodes, b.first_step_t) == (3, True, ("node2",), 111.0)
    with pytest.raises(ValueError, match="not a worker log line"):
        parse_log(["kind=step t=soon step=1"])


def test_a_preemption_with_notice_loses_only_the_save() -> None:
    victim = JobOutcome(_job(0), 99.0, parse_log(LOG.splitlines()))
    high = Attempt(started_t=103.8, resumed_step=0, nodes=("node1",), steps=[(1, 104.5)])
    preemptor = JobOutcome(_job(1, "high"), 103.0, [high])
    (p,) = preemptions([victim, preemptor])
    assert (p.last_step, p.resumed_step, p.lost_steps) == (3, 3, 0)
    assert p.lost_s == pytest.approx(0.6)  # step 3 at 103.0 -> attempt's end 103.6
    assert p.preemptor == 1
    assert p.notice_to_preemptor_step_s == pytest.approx(1.0)
    assert p.stall_s == pytest.approx(0.1)  # notice 103.5 -> saved 103.6
    # lost 0.6 s: more than the stall alone, within the stall and a 0.5 s grace
    assert not within_target(p, grace_s=0.0)
    assert within_target(p, grace_s=0.5)


def test_a_same_class_job_that_takes_the_nodes_back_is_the_preemptor() -> None:
    # A lender of reserved nodes (ADR 0050) preempts its borrower whatever the classes.
    victim = JobOutcome(_job(0, "normal"), 99.0, parse_log(LOG.splitlines()))
    lender = Attempt(started_t=103.7, resumed_step=0, nodes=("node1",), steps=[(1, 104.2)])
    later_high = Attempt(started_t=105.0, resumed_step=0, nodes=("node1",), steps=[(1, 106.0)])
    outcomes = [victim, JobOutcome(_job(1, "normal"), 90.0, [lender])]
    (p,) = preemptions([*outcomes, JobOutcome(_job(2, "high"), 104.0, [later_high])])
    assert p.preemptor == 1
    assert p.notice_to_preemptor_step_s == pytest.approx(0.7)


def test_a_kill_without_notice_loses_the_steps_since_the_checkpoint() -> None:
    killed = Attempt(started_t=0.0, resumed_step=0, nodes=("node1",))
    killed.steps = [(n, float(n)) for n in range(1, 7)]
    killed.last_t = 6.4
    again = Attempt(started_t=10.0, resumed_step=4, nodes=("node1",))
    # a lower-class job on the node is not its preemptor
    other = JobOutcome(_job(1, "low"), 0.0, [Attempt(7.0, 0, ("node1",), [(1, 8.0)])])
    (p,) = preemptions([JobOutcome(_job(0, "normal"), 0.0, [killed, again]), other])
    assert (p.lost_steps, p.notice_t, p.preemptor) == (2, None, None)
    assert p.lost_s == pytest.approx(2.4)  # step 4 done at 4.0, killed at 6.4
    assert p.stall_s is None
    assert not within_target(p, grace_s=2.0)


def test_waiting_includes_requeue_and_never_started_jobs() -> None:
    done = JobOutcome(_job(0), 99.0, parse_log(LOG.splitlines()))
    never = JobOutcome(_job(1), 105.0, [])
    got = waiting_intervals([done, never], end_t=120.0)
    assert got == [(99.0, 100.0, 1.0), (103.6, 110.0, 1.0), (105.0, 120.0, 1.0)]


def test_replay_metrics_of_a_tiny_replay() -> None:
    params = replace(PARAMS, nodes=2, teams=("vision", "nlp"))
    victim = JobOutcome(_job(0), 99.0, parse_log(LOG.splitlines()))
    high = Attempt(103.8, 0, ("node1",), [(1, 104.5)], last_t=106.0, done=True)
    preemptor = JobOutcome(_job(1, "high", "nlp"), 103.0, [high])
    m = replay_metrics([victim, preemptor], params, end_t=120.0, grace_s=0.5)
    assert m["completed"] == 2
    assert m["preemptions"] == m["preemptions_with_notice"] == 1
    assert m["preemptions_within_target"] == 1
    waits = m["wait_s"]
    assert isinstance(waits, dict)
    assert waits["high"]["mean"] == pytest.approx(0.8)
    assert waits["low"]["mean"] == pytest.approx(1.0)
    assert m["makespan_s"] == pytest.approx(111.0 - 99.0)


def test_a_job_requeued_after_its_last_step_is_a_rerun_not_a_preemption() -> None:
    finished = Attempt(0.0, 0, ("node1",), [(1, 1.0), (2, 2.0)], done=True, last_t=2.0)
    again = Attempt(9.0, 2, ("node2",), [], done=True, last_t=9.0)
    o = JobOutcome(_job(0), 0.0, [finished, again])
    assert preemptions([o]) == []
    assert reruns_after_done([o]) == 1
    assert reruns_after_done([JobOutcome(_job(1), 0.0, [finished])]) == 0
