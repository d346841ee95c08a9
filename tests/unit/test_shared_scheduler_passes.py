"""The shared cluster's scheduling policy over many snapshots: invariants that hold for
random ones, and the little simulation (:class:`Sim`) that runs passes over time, starting
and ending jobs and requeueing the preempted, as the controller would."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field, replace

import pytest

from trainpod.scheduler.base import (
    Place,
    Preempt,
    QueuedJob,
    RunningJob,
    SchedulerDecision,
    Snapshot,
)
from trainpod.scheduler.policy import PriorityClass, SharingPolicy, TeamPolicy
from trainpod.scheduler.shared import SharedScheduler
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

# -- invariants over random snapshots ---------------------------------------------------------
RANDOM_TEAMS = ("a", "b", "c")
RANDOM_POLICY = teams(
    TeamPolicy("a", {"gpu": 4}, borrow_limit=3),
    TeamPolicy("b", {"gpu": 6}, lend=False),
    TeamPolicy("c", {"gpu": 2}, borrow=False),
    min_run_s=30.0,
)


def random_snapshot(rng: random.Random, size: int = 16) -> Snapshot:
    now = 1000.0
    names = [f"gpu-{i}" for i in range(size)]
    rng.shuffle(names)
    run: list[RunningJob] = []
    i = 1
    while names and rng.random() < 0.8:
        k = min(len(names), rng.randint(1, 4))
        held, names = names[:k], names[k:]
        run.append(
            running(
                i,
                held,
                team=rng.choice(RANDOM_TEAMS),
                priority=rng.choice((LOW, NORMAL, HIGH)),
                started=now - rng.uniform(0, 200),
                limit=rng.choice((None, 300.0, 1000.0)),
                preemptible=rng.random() < 0.8,
                stopping=rng.random() < 0.1,
            )
        )
        if rng.random() < 0.2:  # started on nodes a waiting job had reserved (ADR 0050)
            run[-1] = replace(run[-1], lent_by=(100 + rng.randrange(12),))
        i += 1
    queue = [
        queued(
            100 + j,
            rng.randint(1, 6),
            team=rng.choice(RANDOM_TEAMS),
            priority=rng.choice((LOW, NORMAL, HIGH)),
            at=rng.uniform(0, now),
            limit=rng.choice((None, 60.0, 600.0)),
        )
        for j in range(rng.randint(0, 12))
    ]
    return snapshot(now, queue, run, size=size)


@pytest.mark.parametrize("seed", range(60))
def test_places_never_break_the_quota_rules_nor_share_a_node(seed: int) -> None:
    snap = random_snapshot(random.Random(seed))
    decisions = SharedScheduler(RANDOM_POLICY).plan(snap)
    free = {n.name for n in snap.nodes if n.free}
    jobs = {q.id: q for q in snap.queue}
    used: dict[str, int] = {}
    for r in snap.running:
        used[r.team] = used.get(r.team, 0) + len(r.nodes)
    quota = {t.name: t.quota_in("gpu") for t in RANDOM_POLICY.teams}
    unassigned = len(snap.nodes) - sum(quota.values())
    given: set[str] = set()
    for d in decisions:
        if isinstance(d, Place):
            q = jobs[d.job_id]
            assert len(d.nodes) == q.nodes and set(d.nodes) <= free and not given & set(d.nodes)
            assert q.preemptible or not d.lent_by
            given |= set(d.nodes)
            t = RANDOM_POLICY.team(q.team)
            assert t is not None
            need = used.get(q.team, 0) + q.nodes - quota[q.team]
            if need > 0:  # it borrows: allowed, within its limit and what others leave idle
                assert t.borrow
                assert t.borrow_limit is None or need <= t.borrow_limit
                lent = sum(
                    max(0, quota[o.name] - used.get(o.name, 0))
                    for o in RANDOM_POLICY.teams
                    if o.lend and o.name != q.team
                )
                others = sum(max(0, used.get(o, 0) - quota[o]) for o in quota if o != q.team)
                assert need <= unassigned + lent - others
            used[q.team] = used.get(q.team, 0) + q.nodes
        elif isinstance(d, Preempt):
            r = next(r for r in snap.running if r.id == d.job_id)
            assert r.preemptible and not r.stopping and snap.now - (r.started_at or 0) >= 30.0
    assert {d.job_id for d in decisions if not isinstance(d, Preempt)} == set(jobs)


def test_the_same_snapshot_gives_the_same_decisions() -> None:
    rng = random.Random(7)
    for _ in range(20):
        snap = random_snapshot(rng)
        assert SharedScheduler(RANDOM_POLICY).plan(snap) == SharedScheduler(RANDOM_POLICY).plan(
            snap
        )


# -- many passes ------------------------------------------------------------------------------
@dataclass
class Sim:
    """Runs passes over time: places start jobs, jobs end after their run time, preempted
    ones stop after the grace period and are queued again."""

    scheduler: SharedScheduler
    size: int
    now: float = 0.0
    queue: dict[int, QueuedJob] = field(default_factory=dict)
    run: dict[int, RunningJob] = field(default_factory=dict)
    runtime: dict[int, float] = field(default_factory=dict)
    stop_at: dict[int, float] = field(default_factory=dict)
    started: dict[int, float] = field(default_factory=dict)
    preempted: list[int] = field(default_factory=list)

    def submit(self, job: QueuedJob, runtime: float) -> None:
        self.queue[job.id] = replace(job, submitted_at=self.now)
        self.runtime[job.id] = runtime

    def snapshot(self) -> Snapshot:
        held = [n for r in self.run.values() for n in r.nodes]
        return snapshot(
            self.now,
            list(self.queue.values()),
            list(self.run.values()),
            cluster(self.size, busy=held),
        )

    def step(self) -> list[SchedulerDecision]:
        decisions = self.scheduler.plan(self.snapshot())
        for d in decisions:
            if isinstance(d, Place):
                q = self.queue.pop(d.job_id)
                self.started.setdefault(q.id, self.now)
                self.run[q.id] = replace(
                    running(q.id, d.nodes, q.team, q.priority, self.now, q.time_limit_s),
                    lent_by=d.lent_by,
                )
            elif isinstance(d, Preempt):
                self.run[d.job_id] = replace(self.run[d.job_id], stopping=True)
                self.stop_at[d.job_id] = self.now + d.grace_s
                self.preempted.append(d.job_id)
        return decisions

    def advance(self, dt: float) -> None:
        self.now += dt
        for r in list(self.run.values()):
            if r.id in self.stop_at and self.stop_at[r.id] <= self.now:
                del self.run[r.id], self.stop_at[r.id]
                self.queue[r.id] = queued(
                    r.id, len(r.nodes), r.team, r.priority, limit=r.time_limit_s
                )
            elif r.started_at is not None and r.started_at + self.runtime[r.id] <= self.now:
                del self.run[r.id]


def test_a_large_job_is_not_starved_by_a_stream_of_small_ones() -> None:
    sim = Sim(SharedScheduler(), size=4)
    for i in range(3):
        sim.submit(queued(i + 1, 1, limit=30.0), runtime=30.0)
    sim.step()
    sim.submit(queued(100, 4, limit=50.0), runtime=50.0)
    small = 1000
    for _ in range(200):  # a new small job every 5 s, each fits in the idle node
        sim.submit(queued(small, 1, limit=30.0), runtime=30.0)
        small += 1
        sim.step()
        sim.advance(5.0)
    assert 100 in sim.started
    # it started once the three first jobs ended; no later small job delayed it
    assert sim.started[100] <= 30.0 + 5.0
    # and the small ones used the idle node meanwhile without pushing it back
    assert any(sim.started.get(j, 1e9) < sim.started[100] for j in range(1000, 1010))


def test_the_same_stream_without_time_limits_waits_behind_the_large_job() -> None:
    sim = Sim(SharedScheduler(), size=4)
    for i in range(3):
        sim.submit(queued(i + 1, 1, limit=30.0), runtime=30.0)
    sim.step()
    sim.submit(queued(100, 4), runtime=50.0)
    small = 1000
    for _ in range(40):
        sim.submit(queued(small, 1), runtime=30.0)
        small += 1
        sim.step()
        sim.advance(5.0)
    assert sim.started[100] <= 35.0
    assert all(sim.started.get(j, 1e9) >= sim.started[100] for j in range(1000, small))


def test_a_preempted_job_comes_back_and_the_preemptor_waits_for_it_once() -> None:
    sim = Sim(SharedScheduler(SharingPolicy(grace_s=20.0, min_run_s=0.0)), size=4)
    sim.submit(queued(1, 4, priority=LOW), runtime=1000.0)
    sim.step()
    sim.advance(10.0)
    sim.submit(queued(2, 2, priority=HIGH), runtime=100.0)
    for _ in range(10):
        sim.step()
        sim.advance(5.0)
    assert sim.preempted == [1]  # once, though several passes ran while it stopped
    assert sim.started[2] == 30.0  # its grace period after the preemption at 10
    assert 1 in sim.queue  # back in the queue, waiting for the high job's nodes


def _lending_run(lend: bool) -> Sim:
    """Job 1 (2 nodes) declares 100 s and runs 40; job 2 wants all 4 nodes; job 3 (2
    nodes, 60 s, declares 500) fits the idle half only by borrowing job 2's reservation."""
    sim = Sim(SharedScheduler(SharingPolicy(min_run_s=0.0, grace_s=5.0, lend_reserved=lend)), 4)
    sim.submit(queued(1, 2, limit=100.0), runtime=40.0)
    sim.step()
    sim.submit(queued(2, 4, limit=100.0), runtime=50.0)
    sim.submit(queued(3, 2, limit=500.0), runtime=60.0)
    for _ in range(100):
        sim.step()
        sim.advance(1.0)
    return sim


def test_a_borrower_fills_the_gap_and_gives_the_nodes_back_once_when_asked() -> None:
    lent, kept = _lending_run(True), _lending_run(False)
    # without lending, the two idle nodes wait 40 s for job 1 to end; job 3 runs after job 2
    assert kept.started == {1: 0.0, 2: 40.0, 3: 90.0} and kept.preempted == []
    # lending: job 3 starts at once, job 2 takes its nodes back when job 1 ends (40 s),
    # after the grace; job 3 is preempted once and starts again when job 2 is done
    assert lent.started[3] == 0.0 and lent.preempted == [3]
    assert lent.started[2] == 45.0  # the grace after job 1's end: no later
    again = lent.run[3]  # once job 2 ended (95 s): its own nodes now, lent by no one
    assert (again.started_at, again.lent_by) == (95.0, ())


# -- policy input -----------------------------------------------------------------------------
def test_bad_policy_values_are_named() -> None:
    with pytest.raises(ValueError, match="quota for partition 'gpu' is -1"):
        TeamPolicy("a", {"gpu": -1})
    with pytest.raises(ValueError, match="weight is 0"):
        TeamPolicy("a", weight=0)
    with pytest.raises(ValueError, match="borrow_limit is -2"):
        TeamPolicy("a", borrow_limit=-2)
    with pytest.raises(ValueError, match="team a is declared twice"):
        SharingPolicy(teams=(TeamPolicy("a"), TeamPolicy("a")))
    with pytest.raises(ValueError, match="half-life above 0"):
        SharingPolicy(half_life_s=0)
    with pytest.raises(ValueError, match="needs a name"):
        PriorityClass("", 1)


def test_borrow_then_reclaim_over_many_passes() -> None:
    sim = Sim(SharedScheduler(replace(VISION_NLP, grace_s=15.0)), size=4)
    sim.submit(queued(1, 2, "vision", priority=LOW), runtime=1000.0)
    sim.submit(queued(2, 2, "vision", priority=LOW), runtime=1000.0)
    sim.step()
    assert set(sim.run) == {1, 2}  # vision borrows nlp's idle half
    sim.advance(60.0)
    sim.submit(queued(3, 2, "nlp", priority=LOW), runtime=100.0)
    for _ in range(10):
        sim.step()
        sim.advance(5.0)
    assert sim.preempted == [1]  # one of the two (equal: the lower id), once
    assert sim.started[3] == 75.0  # after the 15 s grace
    held = holds(sim.step())
    assert held[1].reason == (
        "waiting for quota: team vision uses 2 of its 2 nodes in partition gpu;"
        " other teams have 0 idle nodes to lend and this job needs 2"
    )


def test_a_team_at_its_quota_preempts_its_own_lower_job_for_a_higher_one() -> None:
    policy = teams(TeamPolicy("vision", {"gpu": 2}, borrow=False), TeamPolicy("nlp", {"gpu": 2}))
    run = [running(1, ["gpu-0", "gpu-1"], team="vision", priority=LOW)]
    queue = [queued(2, 1, "vision", priority=HIGH)]
    sched = SharedScheduler(policy)
    d = by_kind(sched.plan(snapshot(100.0, queue, run)))
    assert d["preempt"] == {1: "preempted for job 2 (priority high)"}
    # while it stops, the free nodes are there but the quota is not yet: no second victim
    stopping = [replace(run[0], stopping=True)]
    d2 = by_kind(sched.plan(snapshot(101.0, queue, stopping)))
    assert d2["preempt"] == {} and d2["place"] == {}
    assert d2["hold"] == {
        2: "waiting for job 1 to checkpoint and stop (its nodes are reserved for this job)"
    }
    assert by_kind(sched.plan(snapshot(120.0, queue, [])))["place"] == {2: ("gpu-0",)}


def test_a_preemptor_waiting_for_its_quota_is_not_overtaken_by_its_teams_lower_jobs() -> None:
    """Over passes, as the controller runs them: each low job of the team is preempted at
    most once for the normal job, which starts one grace period after it asked."""
    policy = replace(
        teams(TeamPolicy("speech", {"gpu": 2}, borrow=False), TeamPolicy("nlp", {"gpu": 4})),
        grace_s=1.0,
    )
    sim = Sim(SharedScheduler(policy), size=6)
    sim.submit(queued(1, 1, "speech", priority=LOW), runtime=1000.0)
    sim.step()
    sim.advance(5.0)
    sim.submit(queued(3, 2, "speech", priority=NORMAL), runtime=100.0)
    sim.submit(queued(2, 1, "speech", priority=LOW), runtime=1000.0)
    for _ in range(20):
        sim.step()
        sim.advance(0.5)
    assert sim.preempted == [1]  # once; job 2 never took the quota job 1 gave back
    assert sim.started[3] == 6.0  # the grace after the preemption at 5
    assert 2 not in sim.started and 1 not in sim.run  # both wait behind job 3's quota


def test_a_large_job_waiting_on_a_job_of_unknown_end_is_not_starved_either() -> None:
    # job 1 declares no time limit, so job 100 has no estimate while it runs; small jobs
    # backfill meanwhile, but once job 1 ends the large one gets the next nodes to free up
    sim = Sim(SharedScheduler(), size=4)
    sim.submit(queued(1, 1), runtime=100.0)
    sim.step()
    sim.submit(queued(100, 4, limit=50.0), runtime=50.0)
    small = 1000
    estimates: list[float | None] = []
    for _ in range(100):
        sim.submit(queued(small, 1, limit=30.0), runtime=30.0)
        small += 1
        h = holds(sim.step())
        if 100 in h:
            estimates.append(h[100].estimated_start)
        sim.advance(5.0)
    assert any(sim.started.get(j, 1e9) < 100.0 for j in range(1000, small))  # backfilled
    assert estimates[0] is None  # job 1 may run for ever
    assert 100 in sim.started and sim.started[100] <= 100.0 + 30.0 + 5.0
    # once it has an estimate, no later pass pushes it back
    known = [e for e in estimates if e is not None]
    assert known and all(later <= first for first, later in itertools.pairwise(known))
