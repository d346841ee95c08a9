"""The shared cluster's scheduling policy, as a pure function over snapshots.

Single passes, each checking one decision; many passes over time are in
test_shared_scheduler_passes.py.
"""

from __future__ import annotations

from dataclasses import replace

from trainpod.scheduler.base import (
    Hold,
    Place,
    Preempt,
    still_lending,
)
from trainpod.scheduler.policy import SharingPolicy, TeamPolicy
from trainpod.scheduler.shared import SharedScheduler
from trainpod.scheduler.usage import UsageInterval, decayed_usage
from trainpod.testing.snapshots import (
    HIGH,
    LOW,
    NORMAL,
    by_kind,
    cluster,
    holds,
    queued,
    running,
    snapshot,
    teams,
)

VISION_NLP = teams(
    TeamPolicy("vision", {"gpu": 2}),
    TeamPolicy("nlp", {"gpu": 2}),
)


# -- quotas and borrowing ---------------------------------------------------------------------
def test_quota_stops_a_team_at_its_limit() -> None:
    policy = teams(TeamPolicy("vision", {"gpu": 4}, borrow=False), TeamPolicy("nlp", {"gpu": 4}))
    run = [running(1, ["gpu-0", "gpu-1", "gpu-2", "gpu-3"], team="vision")]
    snap = snapshot(100.0, [queued(2, 1, "vision"), queued(3, 1, "nlp")], run, size=8)
    d = by_kind(SharedScheduler(policy).plan(snap))
    assert d["hold"] == {
        2: "waiting for quota: team vision uses 4 of its 4 nodes in partition gpu (may not borrow)"
    }
    assert d["place"] == {3: ("gpu-4",)}
    assert d["preempt"] == {}


def test_borrowing_lets_a_team_past_its_quota_while_others_are_idle() -> None:
    snap = snapshot(0.0, [queued(1, 4, "vision")])
    assert by_kind(SharedScheduler(VISION_NLP).plan(snap))["place"] == {
        1: ("gpu-0", "gpu-1", "gpu-2", "gpu-3")
    }


def test_borrowing_stops_at_the_borrow_limit_and_at_what_others_lend() -> None:
    limited = teams(TeamPolicy("vision", {"gpu": 2}, borrow_limit=1), TeamPolicy("nlp", {"gpu": 2}))
    snap = snapshot(0.0, [queued(1, 4, "vision")])
    assert by_kind(SharedScheduler(limited).plan(snap))["hold"] == {
        1: "waiting for quota: team vision uses 0 of its 2 nodes in partition gpu;"
        " it may borrow 1 beyond it and this job needs 4"
    }
    stingy = teams(TeamPolicy("vision", {"gpu": 2}), TeamPolicy("nlp", {"gpu": 2}, lend=False))
    assert by_kind(SharedScheduler(stingy).plan(snap))["hold"] == {
        1: "waiting for quota: team vision uses 0 of its 2 nodes in partition gpu;"
        " other teams have 0 idle nodes to lend and this job needs 4"
    }
    # nodes in no team's quota are lent too; once nlp borrows the one, none are left
    nlp2 = [running(9, ["gpu-0", "gpu-1"], team="nlp")]
    snap2 = snapshot(0.0, [queued(1, 3, "vision")], nlp2, size=5)
    assert by_kind(SharedScheduler(VISION_NLP).plan(snap2))["place"] == {
        1: ("gpu-2", "gpu-3", "gpu-4")
    }
    nlp3 = [running(9, ["gpu-0", "gpu-1", "gpu-2"], team="nlp")]
    snap3 = snapshot(0.0, [queued(1, 3, "vision")], nlp3, size=5)
    assert by_kind(SharedScheduler(VISION_NLP).plan(snap3))["hold"] == {
        1: "waiting for quota: team vision uses 0 of its 2 nodes in partition gpu;"
        " other teams have 0 idle nodes to lend and this job needs 3"
    }


def test_quota_its_owner_is_waiting_for_is_not_lent() -> None:
    # vision's high job comes first, but nlp's queued job asks for nlp's idle quota
    queue = [queued(1, 4, "vision", priority=HIGH), queued(2, 2, "nlp", priority=LOW)]
    d = by_kind(SharedScheduler(VISION_NLP).plan(snapshot(0.0, queue)))
    assert d["hold"] == {
        1: "waiting for quota: team vision uses 0 of its 2 nodes in partition gpu;"
        " other teams have 0 idle nodes to lend and this job needs 4"
    }
    assert d["place"] == {2: ("gpu-0", "gpu-1")}


def test_a_job_of_an_unknown_team_is_held_with_the_reason() -> None:
    snap = snapshot(0.0, [queued(1, 1, "robotics"), queued(2, 1, "")])
    h = by_kind(SharedScheduler(VISION_NLP).plan(snap))["hold"]
    assert h[1] == (
        "team robotics is not in the cluster's sharing policy (teams: nlp, vision);"
        " ask an admin to add it"
    )
    assert str(h[2]).startswith("has no team")


def test_reclaim_preempts_the_borrower_when_the_lender_needs_its_nodes() -> None:
    # vision borrows nlp's 2 nodes with two 1-node jobs and one 2-node job of its own quota
    run = [
        running(1, ["gpu-0", "gpu-1"], team="vision", priority=HIGH, started=0.0),
        running(2, ["gpu-2"], team="vision", priority=NORMAL, started=0.0, checkpoint=90.0),
        running(3, ["gpu-3"], team="vision", priority=LOW, started=0.0),
    ]
    snap = snapshot(100.0, [queued(4, 1, "nlp", priority=LOW)], run)
    d = by_kind(SharedScheduler(VISION_NLP).plan(snap))
    # lowest priority first, and only as many as needed; nlp's job is low priority itself
    assert d["preempt"] == {3: "reclaimed for team nlp's quota (job 4)"}
    assert d["hold"] == {4: "waiting for job 3 to checkpoint and stop (preempted for this job)"}
    # a lender asking beyond its own quota reclaims nothing
    snap3 = snapshot(100.0, [queued(4, 3, "nlp", priority=LOW)], run)
    assert by_kind(SharedScheduler(VISION_NLP).plan(snap3))["preempt"] == {}


def test_reclaim_never_takes_work_within_its_teams_quota() -> None:
    run = [
        running(1, ["gpu-0", "gpu-1"], team="vision", priority=LOW),
        running(2, ["gpu-2", "gpu-3"], team="nlp", priority=LOW),
    ]
    snap = snapshot(100.0, [queued(3, 1, "nlp", priority=HIGH)], run)
    # nlp is at its quota and vision borrows nothing: high priority does not cross teams
    d = by_kind(SharedScheduler(VISION_NLP).plan(snap))
    assert d["preempt"] == {2: "preempted for job 3 (priority high)"}


# -- priority and victims ---------------------------------------------------------------------
def test_priority_preempts_the_lower_job_that_loses_least_work() -> None:
    run = [
        running(1, ["gpu-0"], priority=LOW, started=0.0, checkpoint=50.0),
        running(2, ["gpu-1"], priority=LOW, started=0.0, checkpoint=95.0),
        running(3, ["gpu-2"], priority=LOW, started=90.0),
        running(4, ["gpu-3"], priority=NORMAL, started=99.0),
    ]
    snap = snapshot(100.0, [queued(5, 1, priority=HIGH)], run)
    sched = SharedScheduler(SharingPolicy(grace_s=12.0, min_run_s=0.0))  # ages, not min runs
    d = sched.plan(snap)
    assert [x for x in d if isinstance(x, Preempt)] == [
        Preempt(2, "preempted for job 5 (priority high)", 12.0)
    ]
    # two nodes: the two lowest-loss low jobs, never the normal one that lost least
    snap2 = snapshot(100.0, [queued(5, 2, priority=HIGH)], run)
    assert set(by_kind(sched.plan(snap2))["preempt"]) == {2, 3}


def test_only_strictly_lower_priority_jobs_are_victims() -> None:
    run = [running(1, ["gpu-0", "gpu-1", "gpu-2", "gpu-3"], priority=NORMAL)]
    d = by_kind(SharedScheduler().plan(snapshot(10.0, [queued(2, 1, priority=NORMAL)], run)))
    assert d["preempt"] == {}
    assert d["hold"] == {2: "waiting for nodes: needs 1, 0 idle in partition gpu"}


def test_victims_are_preempted_only_if_they_let_the_job_start() -> None:
    run = [
        running(1, ["gpu-0", "gpu-1"], priority=LOW),
        running(2, ["gpu-2", "gpu-3"], priority=HIGH),
    ]
    d = by_kind(SharedScheduler().plan(snapshot(10.0, [queued(3, 3, priority=NORMAL)], run)))
    assert d["preempt"] == {}


def test_unneeded_victims_are_dropped() -> None:
    # greedy order takes 1 (1 node) then 2 (3 nodes); 2 alone is enough, so 1 is spared
    run = [
        running(1, ["gpu-0"], priority=LOW, checkpoint=99.0),
        running(2, ["gpu-1", "gpu-2", "gpu-3"], priority=LOW, checkpoint=50.0),
    ]
    snap = snapshot(100.0, [queued(3, 3, priority=HIGH)], run)
    sched = SharedScheduler(SharingPolicy(min_run_s=0.0))  # both started at 0
    assert set(by_kind(sched.plan(snap))["preempt"]) == {2}


def test_a_non_preemptible_job_is_never_a_victim() -> None:
    run = [running(1, ["gpu-0", "gpu-1", "gpu-2", "gpu-3"], priority=LOW, preemptible=False)]
    d = by_kind(SharedScheduler().plan(snapshot(10.0, [queued(2, 1, priority=HIGH)], run)))
    assert d["preempt"] == {}
    assert 2 in d["hold"]


def test_the_minimum_run_time_protects_a_job_and_the_scheduler_wakes_when_it_ends() -> None:
    policy = SharingPolicy(min_run_s=600.0, grace_s=30.0)
    run = [running(1, ["gpu-0", "gpu-1", "gpu-2", "gpu-3"], priority=LOW, started=1000.0)]
    snap = snapshot(1100.0, [queued(2, 2, priority=HIGH)], run)
    sched = SharedScheduler(policy)
    d = sched.plan(snap)
    assert d == [
        Hold(
            2,
            "waiting for job 1's minimum run time (until 00:26:40 UTC)",
            position=1,
            estimated_start=1630.0,
        )
    ]
    assert sched.wake_at(snap) == 1600.0
    later = replace(snap, now=1600.0)
    assert by_kind(sched.plan(later))["preempt"] == {1: "preempted for job 2 (priority high)"}


def test_a_protected_victim_is_promised_to_the_first_job_waiting_for_it() -> None:
    policy = SharingPolicy(min_run_s=600.0)
    run = [running(1, ["gpu-0", "gpu-1", "gpu-2", "gpu-3"], priority=LOW, started=1000.0)]
    queue = [queued(2, 4, priority=HIGH, at=1.0), queued(3, 2, priority=HIGH, at=2.0)]
    h = holds(SharedScheduler(policy).plan(snapshot(1100.0, queue, run)))
    assert h[2].reason == "waiting for job 1's minimum run time (until 00:26:40 UTC)"
    assert h[3].reason == "waiting for nodes: needs 2, 0 idle in partition gpu"


def test_no_double_preemption_while_victims_are_stopping_and_their_nodes_are_kept() -> None:
    run = [
        running(1, ["gpu-0", "gpu-1"], priority=LOW),
        running(2, ["gpu-2", "gpu-3"], priority=LOW),
    ]
    queue = [queued(3, 2, priority=HIGH), queued(4, 1, priority=LOW, at=5.0)]
    sched = SharedScheduler(SharingPolicy(min_run_s=0.0))  # both started at 0
    first = by_kind(sched.plan(snapshot(100.0, queue, run, size=5)))
    assert list(first["preempt"]) == [1]
    # one node is free, so one victim of 2 nodes is enough
    assert first["place"] == {}
    stopping = [replace(run[0], stopping=True), run[1]]
    second = by_kind(sched.plan(snapshot(105.0, queue, stopping, size=5)))
    assert second["preempt"] == {}
    assert second["hold"][3] == (
        "waiting for job 1 to checkpoint and stop (its nodes are reserved for this job)"
    )
    assert second["place"] == {}  # the free gpu-4 is kept for job 3 too
    # job 3 needs one of job 1's nodes; the other is kept for the next in line
    assert second["hold"][4] == second["hold"][3]


def test_quota_a_preemptor_frees_is_not_given_to_a_lower_job_of_its_team_meanwhile() -> None:
    """Seen in a quota replay: job 3 (2 nodes) preempted its team's low job 1 for quota
    while nodes were free, and the same pass placed the team's other low job 2 on that
    quota; the next pass preempted job 2 for job 3 and placed job 1 again, ~90 times in 13 s,
    while job 3 waited. The quota a preemptor frees is its own from the preemption on."""
    policy = teams(TeamPolicy("speech", {"gpu": 2}, borrow=False), TeamPolicy("nlp", {"gpu": 4}))
    run = [running(1, ["gpu-0"], team="speech", priority=LOW)]
    queue = [queued(3, 2, "speech", priority=NORMAL), queued(2, 1, "speech", priority=LOW)]
    sched = SharedScheduler(policy)
    first = by_kind(sched.plan(snapshot(100.0, queue, run, size=6)))
    assert list(first["preempt"]) == [1]
    assert first["place"] == {}  # job 2 would take the quota job 3 preempted job 1 for
    assert str(first["hold"][2]).startswith("waiting for quota: team speech"), first["hold"]
    # job 1 stopping: job 3 waits for its quota, and job 2 still may not take it
    stopping = [replace(run[0], stopping=True)]
    second = by_kind(sched.plan(snapshot(101.0, queue, stopping, size=6)))
    assert second["preempt"] == {} and second["place"] == {}
    assert "reserved for this job" in str(second["hold"][3])
    # job 1 gone: job 3 starts, and job 2 waits for quota
    third = by_kind(sched.plan(snapshot(102.0, [*queue, queued(1, 1, "speech", LOW)], [], size=6)))
    assert list(third["place"]) == [3]
    assert set(third["hold"]) == {1, 2}


def test_a_victim_s_quota_is_not_lent_to_its_preemptor_since_it_wants_it_back() -> None:
    """Seen in a quota replay: an nlp job of 4 nodes (quota 2) preempted speech's low job
    to borrow speech's quota; once queued, that job wanted its quota back, so the next pass
    refused the nlp job and placed the speech job again, to be preempted again, 36 times.
    A victim's quota, when it fits in it, is not lendable to its preemptor."""
    policy = teams(
        TeamPolicy("speech", {"gpu": 2}),
        TeamPolicy("nlp", {"gpu": 2}),
        TeamPolicy("vision", {"gpu": 2}),
    )
    run = [
        running(1, ["gpu-0"], team="speech", priority=HIGH),
        running(2, ["gpu-1", "gpu-2"], team="speech", priority=LOW),
        running(3, ["gpu-3", "gpu-4"], team="nlp", priority=LOW, stopping=True),
        running(4, ["gpu-5"], team="vision", priority=LOW),
    ]
    sched = SharedScheduler(policy)
    d = by_kind(sched.plan(snapshot(100.0, [queued(5, 4, "nlp", priority=NORMAL)], run, size=6)))
    assert d["preempt"] == {} and d["place"] == {}
    assert str(d["hold"][5]).startswith("waiting for quota: team nlp"), d["hold"]
    # the same victim would do for a job of its own size whose team has the quota to lend
    within = by_kind(sched.plan(snapshot(100.0, [queued(6, 2, "nlp", NORMAL)], run[:2], size=6)))
    assert within["place"] == {6: ("gpu-3", "gpu-4")} and within["preempt"] == {}


# -- backfill ---------------------------------------------------------------------------------
def test_backfill_fills_a_gap_without_delaying_the_head_job() -> None:
    run = [running(1, ["gpu-0", "gpu-1"], started=0.0, limit=100.0)]
    head = queued(2, 4, at=1.0, limit=200.0)
    short = queued(3, 2, at=2.0, limit=50.0)
    long = queued(4, 2, at=3.0, limit=500.0)
    unknown = queued(5, 2, at=4.0)
    sched = SharedScheduler()
    alone = holds(sched.plan(snapshot(10.0, [head], run)))
    d = sched.plan(snapshot(10.0, [head, short, long, unknown], run))
    assert by_kind(d)["place"] == {3: ("gpu-2", "gpu-3")}
    h = holds(d)
    assert h[2].estimated_start == alone[2].estimated_start == 100.0
    assert h[2].reason == "waiting for nodes: needs 4, 2 idle in partition gpu"
    # the short job took the idle nodes; the others come after the head job's time limit
    assert h[4].reason == h[5].reason == "waiting for nodes: needs 2, 0 idle in partition gpu"
    assert h[4].estimated_start == h[5].estimated_start == 300.0


def test_backfill_uses_nodes_the_reservation_does_not_need() -> None:
    # the head job waits for partition a; a job of partition b runs on b now
    nodes = cluster(2, "a", busy=["a-0"]) + cluster(2, "b")
    run = [running(1, ["a-0"], started=0.0, limit=100.0)]
    head = queued(2, 2, at=1.0, groups=frozenset({"a"}))
    other = queued(3, 2, at=2.0, groups=frozenset({"a", "b"}))
    d = SharedScheduler().plan(snapshot(10.0, [head, other], run, nodes=nodes))
    assert by_kind(d)["place"] == {3: ("b-0", "b-1")}
    assert holds(d)[2].estimated_start == 100.0


LENDING = SharingPolicy(min_run_s=0.0, grace_s=5.0)


def test_a_preemptible_job_may_start_on_reserved_nodes_far_enough_from_their_owners_start() -> None:
    run = [running(1, ["gpu-0", "gpu-1"], started=0.0, limit=100.0)]
    head = queued(2, 4, at=1.0, limit=200.0)
    long = queued(3, 2, at=2.0, limit=500.0)  # would end long after the head's start (100)
    d = SharedScheduler(LENDING).plan(snapshot(10.0, [head, long], run))
    assert [x for x in d if isinstance(x, Place)] == [Place(3, ("gpu-2", "gpu-3"), lent_by=(2,))]
    assert holds(d)[2].estimated_start == 100.0  # the head's start does not move
    # too close to the head's start (less than a victim's grace): it waits
    late = by_kind(SharedScheduler(LENDING).plan(snapshot(96.0, [head, long], run)))
    assert late["place"] == {} and late["hold"][3] == "behind job 2 (priority normal)"
    # not preemptible, or the policy says no: it waits, as under Slurm's backfill
    fixed = replace(long, preemptible=False)
    assert by_kind(SharedScheduler(LENDING).plan(snapshot(10.0, [head, fixed], run)))["place"] == {}
    shell = replace(long, interactive=True)  # an allocation a person works in
    assert by_kind(SharedScheduler(LENDING).plan(snapshot(10.0, [head, shell], run)))["place"] == {}
    off = replace(LENDING, lend_reserved=False)
    assert by_kind(SharedScheduler(off).plan(snapshot(10.0, [head, long], run)))["place"] == {}
    # the default minimum run time (120 s) keeps it off a reservation 90 s away
    assert by_kind(SharedScheduler().plan(snapshot(10.0, [head, long], run)))["place"] == {}
    # a reservation with no known start (job 1 declared no limit) may need its nodes any
    # moment: it lends nothing (to a job that declares no limit either)
    endless = [running(1, ["gpu-0", "gpu-1"], started=0.0)]
    unbounded = queued(3, 2, at=2.0)
    d = SharedScheduler(LENDING).plan(snapshot(10.0, [head, unbounded], endless))
    assert by_kind(d)["place"] == {} and holds(d)[2].estimated_start is None
    d = SharedScheduler(LENDING).plan(snapshot(10.0, [head, unbounded], run))
    assert [x for x in d if isinstance(x, Place)] == [Place(3, ("gpu-2", "gpu-3"), lent_by=(2,))]


def test_the_owner_of_lent_nodes_preempts_the_borrower_once_it_can_start() -> None:
    head = queued(2, 4, at=1.0, limit=200.0)
    borrower = replace(running(3, ["gpu-2", "gpu-3"], started=10.0, limit=500.0), lent_by=(2,))
    first = running(1, ["gpu-0", "gpu-1"], started=0.0, limit=100.0)
    sched = SharedScheduler(LENDING)
    # job 1 still runs: taking the borrower's nodes would not let the head start
    plan = sched.plan(snapshot(50.0, [head], [first, borrower]))
    d = by_kind(plan)
    assert d["preempt"] == {} and d["place"] == {}
    # its estimate counts on getting them back when job 1 ends, not at the borrower's limit
    assert holds(plan)[2].estimated_start == 100.0
    # nor does a later job count on the borrower's nodes at its limit: they are the head's
    later = queued(5, 2, at=3.0, limit=50.0)
    assert (
        holds(sched.plan(snapshot(50.0, [head, later], [first, borrower])))[5].estimated_start
        == 300.0
    )
    # job 1 ended early: the head takes its nodes back from the borrower
    d = by_kind(sched.plan(snapshot(60.0, [head], [borrower])))
    assert d["preempt"] == {3: "job 2 needs the nodes it had reserved, lent to this job meanwhile"}
    assert d["hold"] == {2: "waiting for job 3 to checkpoint and stop (preempted for this job)"}
    # a job of the same priority that lent it nothing may not
    other = queued(4, 4, at=0.5, limit=200.0)
    d = by_kind(sched.plan(snapshot(60.0, [other], [borrower])))
    assert d["preempt"] == {}


def test_without_backfill_a_waiting_job_holds_back_later_ones() -> None:
    run = [running(1, ["gpu-0", "gpu-1"], started=0.0, limit=100.0)]
    queue = [queued(2, 4, at=1.0), queued(3, 1, at=2.0, limit=10.0)]
    d = SharedScheduler(SharingPolicy(backfill=False)).plan(snapshot(10.0, queue, run))
    assert by_kind(d)["place"] == {}
    assert holds(d)[3].reason == "behind job 2 (priority normal)"
    assert holds(d)[2].estimated_start == 100.0


# -- order, positions, estimates --------------------------------------------------------------
def test_fair_share_orders_two_teams_by_decayed_usage() -> None:
    day = 86400.0
    policy = teams(TeamPolicy("vision", {"gpu": 2}), TeamPolicy("nlp", {"gpu": 2}), half_life_s=day)
    history = [
        UsageInterval("vision", 4, 0.0, 2 * 3600.0),  # a big run, long ago
        UsageInterval("nlp", 1, 9 * day, 9 * day + 3600.0),  # a small one, recently
    ]
    queue = [queued(1, 4, "vision", at=10.0), queued(2, 4, "nlp", at=20.0)]

    def order_at(now: float) -> list[int]:
        usage = decayed_usage(history, now, policy.half_life_s)
        d = holds(SharedScheduler(policy).plan(snapshot(now, queue, size=0, usage=usage)))
        return sorted(d, key=lambda j: d[j].position or 0)

    # a day after vision's run, vision has used more: nlp goes first despite its later submit
    assert order_at(day) == [2, 1]
    # ten days on, vision's run has decayed below nlp's recent one
    assert order_at(9 * day + 3600.0) == [1, 2]


def test_priority_comes_before_fair_share_and_age() -> None:
    queue = [queued(1, 1, at=1.0), queued(2, 1, at=2.0, priority=HIGH), queued(3, 1, at=0.5)]
    d = holds(SharedScheduler().plan(snapshot(5.0, queue, size=0)))
    assert [d[j].position for j in (2, 3, 1)] == [1, 2, 3]


REASONS_POLICY = teams(
    TeamPolicy("vision", {"gpu": 2}, borrow=False), TeamPolicy("nlp", {"gpu": 4})
)
REASONS_RUN = [
    running(1, ["gpu-0", "gpu-1"], team="vision", started=0.0, limit=300.0, priority=HIGH),
    running(2, ["gpu-2", "gpu-3"], team="nlp", started=0.0, limit=200.0, priority=HIGH),
]
REASONS_QUEUE = [
    queued(10, 1, "vision", at=1.0),
    queued(11, 2, "nlp", at=2.0, priority=HIGH),
    queued(12, 1, "nlp", at=3.0, limit=1000.0),
    queued(13, 1, "nlp", at=4.0, priority=LOW),
]


def test_pending_reasons_positions_and_estimated_starts() -> None:
    policy = replace(REASONS_POLICY, lend_reserved=False)
    d = SharedScheduler(policy).plan(snapshot(50.0, REASONS_QUEUE, REASONS_RUN, size=5))
    assert d == [
        # nlp's high job first: 1 node idle, the other from job 2 at 200
        Hold(11, "waiting for nodes: needs 2, 1 idle in partition gpu", 1, 200.0),
        Hold(
            10,
            "waiting for quota: team vision uses 2 of its 2 nodes in partition gpu"
            " (may not borrow)",
            2,
            None,
        ),
        # the idle node is job 11's: job 12 (ending after 200) may not use it; it gets job
        # 2's other node at 200, and job 13 one of job 1's at 300
        Hold(12, "behind job 11 (priority high)", 3, 200.0),
        Hold(13, "behind job 11 (priority high)", 4, 300.0),
    ]


def test_a_preemptible_job_borrows_a_reserved_node_its_owner_can_take_back() -> None:
    # as above, but job 12 may start on job 11's reserved node although its time limit
    # reaches past job 11's expected start (200): it is preemptible, and 150 s away is more
    # than a victim's grace. Job 11's start does not move; job 13 gets job 2's other node.
    d = SharedScheduler(REASONS_POLICY).plan(snapshot(50.0, REASONS_QUEUE, REASONS_RUN, size=5))
    assert d == [
        Hold(11, "waiting for nodes: needs 2, 1 idle in partition gpu", 1, 200.0),
        Hold(
            10,
            "waiting for quota: team vision uses 2 of its 2 nodes in partition gpu"
            " (may not borrow)",
            2,
            None,
        ),
        Place(12, ("gpu-4",), lent_by=(11,)),
        Hold(13, "waiting for nodes: needs 1, 0 idle in partition gpu", 3, 200.0),
    ]


def test_wake_at_is_the_next_expected_end() -> None:
    run = [
        running(1, ["gpu-0"], started=0.0, limit=100.0),
        running(2, ["gpu-1"], started=0.0, limit=40.0),
        running(3, ["gpu-2"], started=0.0),
    ]
    snap = snapshot(10.0, [queued(4, 4)], run)
    assert SharedScheduler().wake_at(snap) == 40.0
    assert SharedScheduler().wake_at(snapshot(10.0, [queued(4, 1)])) is None


def test_a_lender_queued_again_after_the_loan_no_longer_lends() -> None:
    placed = 100.0
    queued_since = {1: 90.0, 2: 120.0}  # 1 waited through; 2 started meanwhile, queued again
    assert still_lending((1, 2, 3), placed, queued_since) == (1,)  # 3 is not waiting at all
    assert still_lending((2,), placed, {2: placed}) == (2,)  # queued in the same instant
    assert still_lending((), placed, queued_since) == ()
