"""A cluster shared by teams: priorities, fair share, quotas with borrowing, checkpoint-aware
preemption and backfill, as one pure pass over a snapshot.

The pass walks the queue in scheduling order (:mod:`trainpod.scheduler.fairshare`). For each
job, in turn:

1. its team must be one the policy knows (when teams are configured);
2. if the quota rules (:mod:`trainpod.scheduler.quota`) allow it and enough nodes of its
   partition are free now (free nodes an earlier job has claimed count only for a job whose
   time limit ends before that job's expected start: backfill), it is placed;
2b. else, if it is preemptible and enough nodes are free counting those that waiting jobs
   reserved from a known start at least ``max(min_run_s, grace_s)`` away, it is placed on
   them, *lent*: each such job may preempt it once it can start (ADR 0050);
3. else, if nodes of jobs being stopped would make it fit, it claims them and waits: no one
   is preempted twice for the same need, and the quota they give back is its own (steps 3
   and 4: no later job of its team is placed on it meanwhile, to be its next victim);
4. else it looks for victims: strictly lower-priority preemptible jobs (of its own team, of
   borrowing teams, or of anyone when no teams are configured), and, for a team within its
   quota, borrowed work of other teams (reclaim). Lowest priority first, then least work
   lost since the last committed checkpoint; never one inside the minimum run time (the job
   then waits until that time with those victims promised to it, and
   :meth:`SharedScheduler.wake_at` says when). Only a set
   that lets it start is preempted, and victims that turn out unneeded are dropped;
5. else it waits with a reservation at its expected start (from the running jobs' time
   limits) that no later job may delay.

Without backfill, a job that waits holds back every later job that could use its
partition's nodes, as :class:`~trainpod.scheduler.fifo.FifoScheduler` does.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from trainpod.scheduler import fairshare
from trainpod.scheduler.base import (
    Hold,
    Place,
    Preempt,
    QueuedJob,
    RunningJob,
    Scheduler,
    SchedulerDecision,
    Snapshot,
)
from trainpod.scheduler.capacity import Capacity
from trainpod.scheduler.policy import SharingPolicy
from trainpod.scheduler.quota import Key, Quotas
from trainpod.scheduler.victims import Victims, VictimSearch


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))


def label(priority: int, priority_class: str) -> str:
    return f"priority {priority_class or priority}"


@dataclass(frozen=True)
class Outcome:
    decisions: tuple[SchedulerDecision, ...]
    wake_at: float | None


class SharedScheduler(Scheduler):
    """The shared cluster's scheduler; ``policy`` says how it is shared."""

    def __init__(self, policy: SharingPolicy | None = None) -> None:
        self.policy = policy if policy is not None else SharingPolicy()
        self._last: tuple[Snapshot, Outcome] | None = None

    def plan(self, snapshot: Snapshot) -> list[SchedulerDecision]:
        return list(self.outcome(snapshot).decisions)

    def wake_at(self, snapshot: Snapshot) -> float | None:
        return self.outcome(snapshot).wake_at

    def outcome(self, snapshot: Snapshot) -> Outcome:
        """One pass (remembered for the last snapshot, so ``plan`` then ``wake_at`` on the
        same snapshot plan once)."""
        if self._last is not None and self._last[0] is snapshot:
            return self._last[1]
        out = Pass(self.policy, snapshot).run()
        self._last = (snapshot, out)
        return out


@dataclass
class Pass:
    policy: SharingPolicy
    snap: Snapshot
    out: list[SchedulerDecision] = field(default_factory=list)
    wakes: set[float] = field(default_factory=set)

    def __post_init__(self) -> None:
        snap, now = self.snap, self.snap.now
        self.now = now
        group_of = {n.name: n.group for n in snap.nodes}
        self.cap = Capacity(snap.nodes, now, now + self.policy.grace_s)
        self.in_groups: dict[int, Counter[str]] = {}
        usable: Counter[str] = Counter(n.group for n in snap.nodes if n.free)
        for r in snap.running:
            per = Counter(group_of.get(name, "") for name in r.nodes)
            self.in_groups[r.id] = per
            usable.update(per)
            if r.stopping:
                self.cap.add_stopping(r.id, dict(per))
                continue
            end = self.expected_end(r)
            self.cap.add_running(r.id, dict(per), end)
            if r.lent_by:
                self.cap.add_lent(r.id, dict(per), r.lent_by)
            if end is not None and end > now:
                self.wakes.add(end)
        self.stopping_use: Counter[Key] = Counter()
        """Nodes that stopping jobs hold, by (team, partition): quota that comes back soon."""
        for r in snap.running:
            if r.stopping:
                self.stopping_use[(r.team, r.partition)] += len(r.nodes)
        parts = {q.partition: q.groups for q in snap.queue}
        self.quotas = Quotas(
            self.policy,
            ((r.team, r.partition, len(r.nodes)) for r in snap.running),
            {p: sum(usable[g] for g in groups) for p, groups in parts.items()},
            ((q.team, q.partition, q.nodes) for q in snap.queue),
        )
        self.jobs = {q.id: q for q in snap.queue}
        self.settled: dict[tuple[object, ...], tuple[int, int, str]] = {}
        """Job shape -> (capacity version, quota version, reason) of a job that could do
        nothing but wait; a job of the same shape gets the same answer while neither has
        changed (with backfill, where a waiting job does not hold later ones back)."""
        self.pos_of: dict[int, int] = {}
        self.held = 0  # jobs held so far in this pass
        self._no_nodes: dict[tuple[int, int, str], str] = {}
        self.blocked: dict[str, int] = {}  # without backfill: group -> first job waiting
        self.search = VictimSearch(
            snap.running,
            self.in_groups,
            now,
            self.policy.min_run_s,
            self.cap,
            self.quotas,
            self.stopping_use,
        )

    # -- facts about running jobs --------------------------------------------------------------
    def expected_end(self, r: RunningJob) -> float | None:
        if r.time_limit_s is None:
            return None
        start = self.now if r.started_at is None else r.started_at
        return max(self.now, start + r.time_limit_s)

    # -- the walk ------------------------------------------------------------------------------
    def run(self) -> Outcome:
        factors = fairshare.standing(
            self.snap.usage,
            fairshare.weights_for(
                {t.name: t.weight for t in self.policy.teams}, self.snap.queue, self.snap.usage
            ),
        )
        for pos, job in enumerate(fairshare.order(self.snap.queue, factors), 1):
            self.step(job, pos)
        future = [t for t in self.wakes if t > self.now]
        return Outcome(tuple(self.out), min(future) if future else None)

    def hold(self, job: QueuedJob, pos: int, reason: str, start: float | None = None) -> None:
        """``job`` waits; its position counts only the jobs that wait (1: the next to start
        in scheduling order), not those this pass places."""
        self.held += 1
        self.out.append(Hold(job.id, reason, position=self.held, estimated_start=start))

    def block(self, job: QueuedJob) -> None:
        if self.policy.backfill:
            return  # reservations keep later jobs off its nodes instead
        for g in job.groups:
            self.blocked.setdefault(g, job.id)

    def step(self, job: QueuedJob, pos: int) -> None:
        self.pos_of[job.id] = pos
        if self.quotas.active and job.team not in self.quotas.teams:
            self.hold(job, pos, self.team_problem(job))
            return
        groups, n = job.groups, job.nodes
        if not self.policy.backfill:
            ahead = [self.blocked[g] for g in groups if g in self.blocked]
            if ahead:
                first = self.jobs[min(ahead, key=self.pos_of.__getitem__)]
                r = self.cap.reserve(groups, n, job.time_limit_s, job.id)
                self.block(job)
                behind = f"behind job {first.id} ({label(first.priority, first.priority_class)})"
                self.hold(job, pos, behind, r.start)
                return
        shape = (
            groups,
            job.team,
            job.partition,
            job.priority,
            job.preemptible and not job.interactive,
            n,
            job.time_limit_s,
        )
        settled = self.settled.get(shape)
        if settled is not None and settled[:2] == (self.cap.version, self.quotas.version):
            self.hold(job, pos, settled[2])
            return
        end = None if job.time_limit_s is None else self.now + job.time_limit_s
        refusal = self.quotas.refusal(job.team, job.partition, n)
        if refusal is None and self.cap.usable(groups, end) >= n:
            self.place(job, self.cap.place(groups, n, end))
            return
        if refusal is None and self.lend(job, end):
            return
        victims: Victims | None = None
        if self.cap.stuck(groups, n, end):
            victims = self.search.find(job)
            if not victims.found:
                # the common case deep in a long queue: the same answer as below, sooner
                reason = refusal or self.wait_reason(job, free=0)
                if self.policy.backfill:
                    self.settled[shape] = (self.cap.version, self.quotas.version, reason)
                else:
                    self.block(job)
                self.hold(job, pos, reason)
                return
        soon = refusal
        if soon is not None and self.stopping_use:
            soon = self.quotas.refusal(job.team, job.partition, n, self.stopping_use)
        if soon is None:
            waits = self.cap.claim_soon(groups, n)
            if waits is not None:
                if not waits:  # the nodes are free; its quota comes back once these stop
                    waits = self.stopping_quota_for(job)
                self.claim_quota(job)
                self.block(job)
                self.hold(job, pos, f"{waiting_for(waits)} (its nodes are reserved for this job)")
                return
        if victims is None:
            victims = self.search.find(job)
        if victims.found and victims.protected_until is None and victims.unstarted is None:
            self.preempt(job, victims.jobs)
            self.claim_quota(job)
            self.block(job)
            ids = [v.id for v in victims.jobs]
            self.hold(job, pos, f"{waiting_for(ids)} (preempted for this job)")
            return
        if victims.found:
            # it will preempt them once it may: no later job counts on them meanwhile
            self.block(job)
            self.claim_quota(job)
            self.cap.promise([v.id for v in victims.jobs])
            until = victims.protected_until
            r = self.cap.reserve(groups, n, job.time_limit_s, job.id, hold_until=until)
            if until is None:
                reason = f"waiting for job {victims.unstarted}'s minimum run time (it is starting)"
                self.hold(job, pos, reason, r.start)
                return
            self.wakes.add(until)
            named = victims.last_protected
            reason = f"waiting for job {named}'s minimum run time (until {clock(until)})"
            self.hold(job, pos, reason, until + self.policy.grace_s)
            return
        if refusal is not None:
            if not self.policy.backfill:
                self.block(job)
            self.hold(job, pos, refusal)
            return
        reason = self.wait_reason(job)
        r = self.cap.reserve(groups, n, job.time_limit_s, job.id)
        self.block(job)
        self.hold(job, pos, reason, r.start)

    def place(self, job: QueuedJob, nodes: tuple[str, ...], lent_by: tuple[int, ...] = ()) -> None:
        self.quotas.add(job.team, job.partition, job.nodes)
        self.out.append(Place(job.id, nodes, job.requeued, lent_by=lent_by))

    def lend(self, job: QueuedJob, end: float | None) -> bool:
        """Start a preemptible ``job`` on nodes that waiting jobs have reserved from a start
        at least ``lend_min_s`` away, though its time limit (or none) reaches past it: those
        jobs may preempt it once they can start (ADR 0050). True if placed."""
        policy = self.policy
        if not (policy.backfill and policy.lend_reserved and job.preemptible):
            return False
        if job.interactive:
            return False  # a person's shell is not started where it will be taken away
        after = self.now + policy.lend_min_s
        if self.cap.lendable(job.groups, after) < job.nodes:
            return False
        nodes, owners = self.cap.place_lent(job.groups, job.nodes, end, after)
        self.place(job, nodes, owners)
        return True

    def claim_quota(self, job: QueuedJob) -> None:
        """``job`` will start once the jobs it preempts or waits for have stopped: the quota
        they give back is its own from now on, so no later job of its team is placed on it
        in the meantime (such a job would be the next victim, preempted and placed again
        in turn while ``job`` waits: a livelock seen in a quota replay)."""
        self.quotas.add(job.team, job.partition, job.nodes)

    def wait_reason(self, job: QueuedJob, free: int | None = None) -> str:
        """Why a job waits for nodes: nodes an earlier job has claimed, or too few idle
        (``free``: the unclaimed free nodes of its groups, where the caller knows them)."""
        if self.cap.idle_in(job.groups) >= job.nodes:
            claimant = self.cap.first_claimant(job.groups)
            if claimant is not None:
                first = self.jobs[claimant]
                return f"behind job {first.id} ({label(first.priority, first.priority_class)})"
        return self.no_nodes(job, self.cap.free_in(job.groups) if free is None else free)

    def no_nodes(self, job: QueuedJob, free: int) -> str:
        key = (job.nodes, free, job.partition)
        reason = self._no_nodes.get(key)
        if reason is None:
            where = f"partition {job.partition}" if job.partition else "its partition"
            reason = f"waiting for nodes: needs {job.nodes}, {free} idle in {where}"
            self._no_nodes[key] = reason
        return reason

    def stopping_quota_for(self, job: QueuedJob) -> list[int]:
        """The stopping jobs whose quota ``job`` waits for: its team's in its partition
        first, else the borrowers' there."""
        stopping = [r for r in self.snap.running if r.stopping and r.partition == job.partition]
        own = [r.id for r in stopping if r.team == job.team]
        return sorted(own or [r.id for r in stopping])

    def team_problem(self, job: QueuedJob) -> str:
        if not self.quotas.active or job.team in self.quotas.teams:
            return ""
        known = ", ".join(sorted(self.quotas.teams))
        if not job.team:
            return (
                "has no team: this cluster shares its nodes by team; submit it as a member"
                f" of one of: {known}"
            )
        if job.team not in self.quotas.teams:
            return (
                f"team {job.team} is not in the cluster's sharing policy (teams: {known});"
                " ask an admin to add it"
            )
        return ""

    # -- preemption ----------------------------------------------------------------------------
    def preempt(self, job: QueuedJob, victims: list[RunningJob]) -> None:
        self.cap.claim_victims(
            job.groups, job.nodes, {v.id: dict(self.in_groups[v.id]) for v in victims}
        )
        for v in victims:
            if job.id in v.lent_by:
                why = f"job {job.id} needs the nodes it had reserved, lent to this job meanwhile"
            elif v.priority < job.priority:
                why = f"preempted for job {job.id} ({label(job.priority, job.priority_class)})"
            else:
                why = f"reclaimed for team {job.team}'s quota (job {job.id})"
            self.out.append(Preempt(v.id, why, self.policy.grace_s))


def waiting_for(ids: list[int]) -> str:
    if len(ids) == 1:
        return f"waiting for job {ids[0]} to checkpoint and stop"
    return f"waiting for jobs {', '.join(map(str, ids))} to checkpoint and stop"
