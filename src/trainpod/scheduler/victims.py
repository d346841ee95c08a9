"""Which running jobs to preempt for a queued one, checkpoint-aware.

Candidates are the preemptible running jobs that are not stopping, best victim first: lowest
priority, then least work lost (time since the last committed checkpoint, or since the
start), then lowest id. A job may take:

* strictly lower-priority jobs of its own team, of teams that borrow, or of anyone when no
  teams are configured;
* if its team is within its quota, any work of other teams while they borrow (reclaim);
* a job started on nodes it had reserved (``lent_by``, ADR 0050), whatever its priority.

Never one inside its minimum run time: if only such a set would do, the job waits for the
time the last of them leaves it, and the set is promised to it (no later job in the pass
counts on those jobs). Victims are added in order until the job could start (its
nodes and its quota), then those that turned out unneeded are dropped, as Kueue does. A
victim goes back to the queue and wants its team's quota again (if it fits in it): that
quota is not lent to the job that preempts it, or the next pass would find the job refused
and the victim placed again, to be preempted again (a livelock seen in a quota replay).

A search remembers, for the rest of a pass, what it could not find: the pass only makes
victims scarcer (victims taken, releases counted on, quota used), and a lower priority or a
larger job has fewer candidates and needs more.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from trainpod.scheduler.base import QueuedJob, RunningJob
from trainpod.scheduler.capacity import Capacity
from trainpod.scheduler.quota import Key, Quotas


@dataclass
class Victims:
    jobs: list[RunningJob]
    protected_until: float | None = None  # set when they are inside their minimum run time
    unstarted: int | None = None  # a needed victim that has not started yet
    last_protected: int | None = None  # the one that leaves its minimum run time last
    found: bool = True


NONE = Victims([], found=False)


@dataclass(frozen=True)
class Candidate:
    """A running job that might be preempted for jobs of some node groups."""

    job: RunningJob
    useful: int  # its nodes in those groups
    protected: bool  # inside its minimum run time


class VictimSearch:
    def __init__(
        self,
        running: Sequence[RunningJob],
        in_groups: Mapping[int, Counter[str]],
        now: float,
        min_run_s: float,
        cap: Capacity,
        quotas: Quotas,
        stopping_use: Counter[Key],
    ) -> None:
        self.now = now
        self.min_run_s = min_run_s
        self.in_groups = in_groups
        self.cap = cap
        self.quotas = quotas
        self.stopping_use = stopping_use
        self.candidates = sorted(
            (r for r in running if r.preemptible and not r.stopping),
            key=lambda r: (r.priority, self.lost_work(r), r.id),
        )
        self.lenders = {lender for r in self.candidates for lender in r.lent_by}
        """Waiting jobs whose reserved nodes a running job was started on: they may preempt
        it whatever the priorities (ADR 0050)."""
        self.near: dict[frozenset[str], list[Candidate]] = {}
        """Groups -> the candidates holding nodes in them, in candidate order."""
        self.no_victims: dict[tuple[frozenset[str], str, str], list[tuple[int, int]]] = {}
        """(groups, team, partition) -> (priority, nodes) no victim set was found for."""

    def lost_work(self, r: RunningJob) -> float:
        since = r.last_checkpoint_at if r.last_checkpoint_at is not None else r.started_at
        return 0.0 if since is None else max(0.0, self.now - since)

    def protected(self, r: RunningJob) -> bool:
        if self.min_run_s <= 0:
            return False
        return r.started_at is None or self.now - r.started_at < self.min_run_s

    def find(self, job: QueuedJob) -> Victims:
        """The victims that would let ``job`` start (see the module's docstring)."""
        key = (job.groups, job.team, job.partition)
        failed = self.no_victims.setdefault(key, [])
        if not self.candidates:
            return NONE
        lender = job.id in self.lenders
        for p, n in failed:
            if job.priority <= p and job.nodes >= n and not lender:
                return NONE
        near = self.near.get(job.groups)
        if near is None:
            near = []
            for c in self.candidates:
                per = self.in_groups[c.id]
                useful = sum(per[g] for g in job.groups if g in per)
                if useful:
                    near.append(Candidate(c, useful, self.protected(c)))
            self.near[job.groups] = near
        base = self.cap.free_in(job.groups) + self.cap.stopping_in(job.groups)
        seen: list[Candidate] = []
        chosen = self.select(job, self.eligible(job, near, seen), base, protected_ok=False)
        if chosen is not None:
            return Victims(chosen)
        if self.min_run_s > 0 and base + sum(c.useful for c in seen) >= job.nodes:
            picked = self.select_candidates(job, seen, base, protected_ok=True)
            if picked is not None:
                return self.guarded(picked)
        if not lender:  # what a lender finds is its own: it says nothing of others
            failed[:] = [(p, n) for p, n in failed if not (p <= job.priority and n >= job.nodes)]
            failed.append((job.priority, job.nodes))
        return NONE

    def eligible(
        self, job: QueuedJob, near: list[Candidate], seen: list[Candidate]
    ) -> Iterator[Candidate]:
        """The running jobs ``job`` may preempt, best victim first (each also added to
        ``seen``): lower-priority ones (of its own team or, with teams, of teams that
        borrow; of anyone without teams), and for a job within its team's quota, any work of
        teams that borrow (reclaim)."""
        q = self.quotas
        active = q.active
        within = q.within(job.team, job.partition, job.nodes)
        dead, relied = self.cap.dead, self.cap.relied_on
        lender = job.id in self.lenders
        for cand in near:
            c = cand.job
            if c.id in dead or c.id in relied:
                continue
            if job.id in c.lent_by:  # started on nodes this job had reserved (ADR 0050)
                seen.append(cand)
                yield cand
                continue
            lower = c.priority < job.priority
            if not lower and not within:
                if lender:
                    continue  # a job it lent its nodes to may come later
                return  # sorted by priority: no later one is lower either
            if active and c.team != job.team:
                if not q.borrowing(c.team, c.partition):
                    continue
            elif not lower:
                continue
            seen.append(cand)
            yield cand

    def guarded(self, chosen: list[Candidate]) -> Victims:
        """A victim set that waits for its members' minimum run time: when the last of them
        leaves it, and which one that is."""
        guarded = [v.job for v in chosen if v.protected]
        jobs = [v.job for v in chosen]
        unstarted = [v.id for v in guarded if v.started_at is None]
        if unstarted:
            return Victims(jobs, unstarted=unstarted[0])
        last = max(guarded, key=lambda v: ((v.started_at or 0.0), v.id))
        until = (last.started_at or 0.0) + self.min_run_s
        return Victims(jobs, protected_until=until, last_protected=last.id)

    def select(
        self, job: QueuedJob, cands: Iterable[Candidate], base: int, protected_ok: bool
    ) -> list[RunningJob] | None:
        """The fewest victims, in candidate order, that let ``job`` start (None: none do)."""
        chosen = self.select_candidates(job, cands, base, protected_ok)
        return None if chosen is None else [v.job for v in chosen]

    def select_candidates(
        self, job: QueuedJob, cands: Iterable[Candidate], base: int, protected_ok: bool
    ) -> list[Candidate] | None:
        q = self.quotas
        chosen: list[Candidate] = []
        minus: Counter[Key] = Counter(self.stopping_use)
        back: Counter[Key] = Counter()
        got = base
        for cand in cands:
            if cand.protected and not protected_ok:
                continue
            c = cand.job
            lent = job.id in c.lent_by
            if (
                q.active
                and c.team != job.team
                and not lent
                and not q.borrowing(c.team, c.partition, minus)
            ):
                continue
            chosen.append(cand)
            key = (c.team, c.partition)
            minus[key] += len(c.nodes)
            back[key] += q.wants_back(c.team, c.partition, len(c.nodes))
            got += cand.useful
            refusal = q.refusal(job.team, job.partition, job.nodes, minus, back)
            if got >= job.nodes and refusal is None:
                break
        else:
            return None
        for cand in reversed(list(chosen)):
            trial = [v for v in chosen if v is not cand]
            if self.feasible(job, trial, base):
                chosen = trial
        return chosen

    def feasible(self, job: QueuedJob, victims: list[Candidate], base: int) -> bool:
        if base + sum(v.useful for v in victims) < job.nodes:
            return False
        q = self.quotas
        minus: Counter[Key] = Counter(self.stopping_use)
        back: Counter[Key] = Counter()
        for v in victims:
            key = (v.job.team, v.job.partition)
            minus[key] += len(v.job.nodes)
            back[key] += q.wants_back(v.job.team, v.job.partition, len(v.job.nodes))
        return q.refusal(job.team, job.partition, job.nodes, minus, back) is None
