"""A cluster shared by teams: priorities, fair share, quotas with borrowing, checkpoint-aware
preemption and backfill, as one pure pass over a snapshot.

The pass walks the queue in scheduling order (:mod:`trainpod.scheduler.fairshare`). For each
job, in turn:

1. its team must be one the policy knows (when teams are configured);
2. if the quota rules (:mod:`trainpod.scheduler.quota`) allow it and enough nodes of its
   partition are free now (free nodes an earlier job has claimed count only for a job whose
   time limit ends before that job's expected start: backfill), it is placed;
3. else, if nodes of jobs being stopped would make it fit, it claims them and waits: no one
   is preempted twice for the same need;
4. else it looks for victims: strictly lower-priority preemptible jobs (of its own team, of
   borrowing teams, or of anyone when no teams are configured), and, for a team within its
   quota, borrowed work of other teams (reclaim). Lowest priority first, then least work
   lost since the last committed checkpoint; never one inside the minimum run time (the job
   then waits until that time, and :meth:`SharedScheduler.wake_at` says when). Only a set
   that lets it start is preempted, and victims that turn out unneeded are dropped;
5. else it waits with a reservation at its expected start (from the running jobs' time
   limits) that no later job may delay.

Without backfill, a job that waits holds back every later job that could use its
partition's nodes, as :class:`~trainpod.scheduler.fifo.FifoScheduler` does.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
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
class Victims:
    jobs: list[RunningJob]
    protected_until: float | None = None  # set when they are inside their minimum run time
    unstarted: int | None = None  # a needed victim that has not started yet
    found: bool = True


NONE = Victims([], found=False)


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
        self.candidates = sorted(
            (r for r in snap.running if r.preemptible and not r.stopping),
            key=lambda r: (r.priority, self.lost_work(r), r.id),
        )
        self.jobs = {q.id: q for q in snap.queue}
        self.pos_of: dict[int, int] = {}
        self.held = 0  # jobs held so far in this pass
        self._no_nodes: dict[tuple[int, int, str], str] = {}
        self.blocked: dict[str, int] = {}  # without backfill: group -> first job waiting
        self.near: dict[frozenset[str], list[RunningJob]] = {}
        """Groups -> the candidates holding nodes in them, in candidate order."""
        self.no_victims: dict[tuple[frozenset[str], str, str], list[tuple[int, int]]] = {}
        """(groups, team, partition) -> (priority, nodes) no victim set was found for. The
        pass only makes victims scarcer, and a lower priority or a larger job has fewer
        candidates and needs more, so such a job finds none either."""

    # -- facts about running jobs --------------------------------------------------------------
    def expected_end(self, r: RunningJob) -> float | None:
        if r.time_limit_s is None:
            return None
        start = self.now if r.started_at is None else r.started_at
        return max(self.now, start + r.time_limit_s)

    def lost_work(self, r: RunningJob) -> float:
        since = r.last_checkpoint_at if r.last_checkpoint_at is not None else r.started_at
        return 0.0 if since is None else max(0.0, self.now - since)

    def protected(self, r: RunningJob) -> bool:
        if self.policy.min_run_s <= 0:
            return False
        return r.started_at is None or self.now - r.started_at < self.policy.min_run_s

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
        end = None if job.time_limit_s is None else self.now + job.time_limit_s
        refusal = self.quotas.refusal(job.team, job.partition, n)
        victims: Victims | None = None
        if self.cap.stuck(groups, n, end):
            victims = self.victims(job)
            if not victims.found:
                # the common case deep in a long queue: the same answer as below, sooner
                self.block(job)
                self.hold(job, pos, refusal or self.no_nodes(job, 0))
                return
        if refusal is None and self.cap.usable(groups, end) >= n:
            nodes = self.cap.place(groups, n, end)
            self.quotas.add(job.team, job.partition, n)
            self.out.append(Place(job.id, nodes, job.requeued))
            return
        soon = refusal
        if soon is not None and self.stopping_use:
            soon = self.quotas.refusal(job.team, job.partition, n, self.stopping_use)
        if soon is None:
            waits = self.cap.claim_soon(groups, n)
            if waits is not None:
                if not waits:  # the nodes are free; its quota comes back once these stop
                    waits = self.stopping_quota_for(job)
                self.block(job)
                self.hold(job, pos, f"{waiting_for(waits)} (its nodes are reserved for this job)")
                return
        if victims is None:
            victims = self.victims(job)
        if victims.found and victims.protected_until is None and victims.unstarted is None:
            self.preempt(job, victims.jobs)
            self.block(job)
            ids = [v.id for v in victims.jobs]
            self.hold(job, pos, f"{waiting_for(ids)} (preempted for this job)")
            return
        if victims.found:
            self.block(job)
            until = victims.protected_until
            r = self.cap.reserve(groups, n, job.time_limit_s, job.id, hold_until=until)
            if until is None:
                reason = f"waiting for job {victims.unstarted}'s minimum run time (it is starting)"
                self.hold(job, pos, reason, r.start)
                return
            self.wakes.add(until)
            named = max(victims.jobs, key=lambda v: (v.started_at or 0.0, v.id))
            reason = f"waiting for job {named.id}'s minimum run time (until {clock(until)})"
            self.hold(job, pos, reason, until + self.policy.grace_s)
            return
        if refusal is not None:
            if not self.policy.backfill:
                self.block(job)
            self.hold(job, pos, refusal)
            return
        idle, free = self.cap.idle_in(groups), self.cap.free_in(groups)
        claimants = self.cap.claimants(groups)
        r = self.cap.reserve(groups, n, job.time_limit_s, job.id)
        self.block(job)
        if idle >= n and claimants:
            first = self.jobs[min(claimants, key=self.pos_of.__getitem__)]
            reason = f"behind job {first.id} ({label(first.priority, first.priority_class)})"
        else:
            reason = self.no_nodes(job, free)
        self.hold(job, pos, reason, r.start)

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
    def victims(self, job: QueuedJob) -> Victims:
        key = (job.groups, job.team, job.partition)
        failed = self.no_victims.setdefault(key, [])
        if not self.candidates:
            return NONE
        for p, n in failed:
            if job.priority <= p and job.nodes >= n:
                return NONE
        near = self.near.get(job.groups)
        if near is None:
            near = [
                c for c in self.candidates if not self.in_groups[c.id].keys().isdisjoint(job.groups)
            ]
            self.near[job.groups] = near
        base = self.cap.free_in(job.groups) + self.cap.stopping_in(job.groups)
        chosen = self.select(job, self.eligible(job, near), base, protected_ok=False)
        if chosen is not None:
            return Victims(chosen)
        if self.policy.min_run_s > 0:
            chosen = self.select(job, self.eligible(job, near), base, protected_ok=True)
            if chosen is not None:
                guarded = [v for v in chosen if self.protected(v)]
                unstarted = [v.id for v in guarded if v.started_at is None]
                if unstarted:
                    return Victims(guarded, unstarted=unstarted[0])
                until = max((v.started_at or 0.0) + self.policy.min_run_s for v in guarded)
                return Victims(guarded, protected_until=until)
        failed[:] = [(p, n) for p, n in failed if not (p <= job.priority and n >= job.nodes)]
        failed.append((job.priority, job.nodes))
        return NONE

    def eligible(self, job: QueuedJob, near: list[RunningJob]) -> Iterator[RunningJob]:
        """The running jobs ``job`` may preempt, best victim first: lower-priority ones (of
        its own team or, with teams, of teams that borrow; of anyone without teams), and for
        a job within its team's quota, any work of teams that borrow (reclaim)."""
        q = self.quotas
        active = q.active
        within = q.within(job.team, job.partition, job.nodes)
        dead, relied = self.cap.dead, self.cap.relied_on
        for c in near:
            lower = c.priority < job.priority
            if not lower and not within:
                return  # sorted by priority: no later one is lower either
            if c.id in dead or c.id in relied:
                continue
            if active and c.team != job.team:
                if q.borrowing(c.team, c.partition):
                    yield c
            elif lower:
                yield c

    def select(
        self, job: QueuedJob, cands: Iterable[RunningJob], base: int, protected_ok: bool
    ) -> list[RunningJob] | None:
        """The fewest victims, in candidate order, that let ``job`` start (None: none do)."""
        q = self.quotas
        chosen: list[RunningJob] = []
        minus: Counter[Key] = Counter(self.stopping_use)
        got = base
        for c in cands:
            if not protected_ok and self.protected(c):
                continue
            if q.active and c.team != job.team and not q.borrowing(c.team, c.partition, minus):
                continue
            chosen.append(c)
            minus[(c.team, c.partition)] += len(c.nodes)
            got += self.useful(c, job)
            if got >= job.nodes and self.feasible(job, chosen, base):
                break
        else:
            return None
        for c in reversed(list(chosen)):
            trial = [v for v in chosen if v is not c]
            if self.feasible(job, trial, base):
                chosen = trial
        return chosen

    def useful(self, victim: RunningJob, job: QueuedJob) -> int:
        per = self.in_groups[victim.id]
        return sum(per[g] for g in job.groups if g in per)

    def feasible(self, job: QueuedJob, victims: list[RunningJob], base: int) -> bool:
        if base + sum(self.useful(v, job) for v in victims) < job.nodes:
            return False
        minus: Counter[Key] = Counter(self.stopping_use)
        for v in victims:
            minus[(v.team, v.partition)] += len(v.nodes)
        return self.quotas.refusal(job.team, job.partition, job.nodes, minus) is None

    def preempt(self, job: QueuedJob, victims: list[RunningJob]) -> None:
        self.cap.claim_victims(
            job.groups, job.nodes, {v.id: dict(self.in_groups[v.id]) for v in victims}
        )
        for v in victims:
            if v.priority < job.priority:
                why = f"preempted for job {job.id} ({label(job.priority, job.priority_class)})"
            else:
                why = f"reclaimed for team {job.team}'s quota (job {job.id})"
            self.out.append(Preempt(v.id, why, self.policy.grace_s))


def waiting_for(ids: list[int]) -> str:
    if len(ids) == 1:
        return f"waiting for job {ids[0]} to checkpoint and stop"
    return f"waiting for jobs {', '.join(map(str, ids))} to checkpoint and stop"
