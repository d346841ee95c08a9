"""Node capacity over time for one scheduling pass, kept as counts per node group.

Per group it holds:

* the free nodes (names in the spec's order; whoever places takes from the front) and how
  many of them are still unclaimed;
* *holes*: free nodes a waiting job has claimed from its expected start on; until then a job
  whose time limit ends before that start may use them (backfill);
* nodes of stopping jobs (free soon);
* a heap of future releases: when each running job's nodes come free (from its time limit;
  never for an unknown one), and those of jobs placed or reserved during this pass.

A waiting job's reservation takes the earliest nodes to come free in its groups; its start is
when the last of them does. Every operation touches the job's groups and the entries it
consumes, never every node.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from trainpod.scheduler.base import NodeSlot

INF = float("inf")
NO_OWNER = -1


@dataclass
class Hole:
    deadline: float  # the claimant's expected start: a job using it must end by then
    count: int
    owner: int  # the queued job that claimed it
    seq: int  # claims are numbered in the pass's order


@dataclass
class Group:
    rank: int  # its first node's index in the spec: groups are used in this order
    names: list[str] = field(default_factory=list)  # free nodes in spec order
    taken: int = 0  # names[:taken] were placed this pass
    free: int = 0  # free and unclaimed
    holes: list[Hole] = field(default_factory=list)  # in the order they were claimed
    hole_index: tuple[int, list[float], list[int]] | None = None
    """(version, deadlines ascending, nodes in holes with that deadline or later)."""
    stopping: list[list[int]] = field(default_factory=list)  # [running job, nodes left]
    stopping_left: int = 0  # the sum of those
    lent: list[tuple[int, list[int], frozenset[int]]] = field(default_factory=list)
    """(running job, [its nodes here not yet reclaimed], the waiting jobs that lent them):
    a lender may take them back by preemption (ADR 0050)."""
    future: list[list[float]] = field(default_factory=list)  # heap [time, seq, count, owner]
    finite: int = 0  # nodes in ``future`` with a known time, not yet reserved


@dataclass(frozen=True)
class Reservation:
    start: float | None  # None: it depends on a job with no known end


class Capacity:
    def __init__(self, nodes: Sequence[NodeSlot], now: float, soon: float) -> None:
        """``soon``: when a stopping job's nodes are expected to be free."""
        self.now = now
        self.soon = soon
        self.groups: dict[str, Group] = {}
        self.index: dict[str, int] = {}
        self._seq = 0
        self._sets: dict[frozenset[str], list[Group]] = {}
        self.version = 0  # bumped by every change a decision makes
        self._idle: dict[frozenset[str], int] = {}  # until the next placement
        self._holes_version = 0  # bumped whenever holes change
        self._claimants: dict[frozenset[str], tuple[int, int | None]] = {}
        self._entries: dict[int, list[tuple[Group, list[float]]]] = {}  # running job -> its
        self.dead: set[int] = set()  # running jobs whose nodes went to a preemptor
        self.relied_on: set[int] = set()
        """Running jobs whose release a reservation counts on, or that a waiting job will
        preempt: not victims for anyone else."""
        for i, n in enumerate(nodes):
            self.index[n.name] = i
            g = self.groups.get(n.group)
            if g is None:
                g = self.groups[n.group] = Group(rank=i)
            if n.free:
                g.names.append(n.name)
                g.free += 1

    def _ordered(self, groups: frozenset[str]) -> list[Group]:
        gs = self._sets.get(groups)
        if gs is None:
            gs = sorted((self.groups[g] for g in groups if g in self.groups), key=lambda g: g.rank)
            self._sets[groups] = gs
        return gs

    # -- what is there now ---------------------------------------------------------------------
    def free_in(self, groups: frozenset[str]) -> int:
        return sum(g.free for g in self._ordered(groups))

    def idle_in(self, groups: frozenset[str]) -> int:
        """Free nodes not yet placed, claimed or not."""
        idle = self._idle.get(groups)
        if idle is None:
            idle = self._idle[groups] = sum(len(g.names) - g.taken for g in self._ordered(groups))
        return idle

    def usable(self, groups: frozenset[str], end: float | None) -> int:
        """Nodes a job ending at ``end`` (None: unknown) could start on now."""
        total = 0
        for g in self._ordered(groups):
            total += g.free
            if end is not None and g.holes:
                total += self._holes_from(g, end)
        return total

    def stuck(self, groups: frozenset[str], n: int, end: float | None) -> bool:
        """Nothing in these groups can start, be claimed soon or get a known start for ``n``
        nodes: none free, none stopping, too few coming free at known times, and no holes
        this job could use. (Victims may still help.)"""
        finite = usable = 0
        for g in self._ordered(groups):
            if g.free or g.stopping_left:
                return False
            finite += g.finite
            if g.holes and end is not None:
                usable += self._holes_from(g, end)
        return finite < n and usable < n

    def _holes_from(self, g: Group, end: float) -> int:
        """Nodes in ``g``'s holes whose deadline is ``end`` or later."""
        index = g.hole_index
        if index is None or index[0] != self._holes_version:
            holes = sorted(g.holes, key=lambda h: h.deadline)
            deadlines = [h.deadline for h in holes]
            after = [0] * (len(holes) + 1)
            for i in range(len(holes) - 1, -1, -1):
                after[i] = after[i + 1] + holes[i].count
            index = g.hole_index = (self._holes_version, deadlines, after)
        return index[2][bisect.bisect_left(index[1], end)]

    def stopping_in(self, groups: frozenset[str]) -> int:
        return sum(g.stopping_left for g in self._ordered(groups))

    def first_claimant(self, groups: frozenset[str]) -> int | None:
        """The first job (in the pass's order) holding free nodes of these groups for its
        reservation."""
        cached = self._claimants.get(groups)
        if cached is not None and cached[0] == self._holes_version:
            return cached[1]
        first = min(
            ((h.seq, h.owner) for g in self._ordered(groups) for h in g.holes), default=None
        )
        out = None if first is None else first[1]
        self._claimants[groups] = (self._holes_version, out)
        return out

    # -- running jobs --------------------------------------------------------------------------
    def add_running(self, job: int, per_group: dict[str, int], end: float | None) -> None:
        for name, count in per_group.items():
            g = self.groups.get(name)
            if g is not None and end is not None:
                self._push(g, end, count, job)

    def add_stopping(self, job: int, per_group: dict[str, int]) -> None:
        for name, count in per_group.items():
            g = self.groups.get(name)
            if g is not None:
                g.stopping.append([job, count])
                g.stopping_left += count

    def add_lent(self, job: int, per_group: dict[str, int], lenders: Iterable[int]) -> None:
        """A running job started on nodes waiting jobs had reserved: to those jobs its nodes
        come free one grace period after they ask (they preempt it)."""
        owners = frozenset(lenders)
        for name, count in per_group.items():
            g = self.groups.get(name)
            if g is not None:
                g.lent.append((job, [count], owners))

    def _push(self, g: Group, time: float, count: int, owner: int) -> None:
        self._seq += 1
        entry = [time, self._seq, count, owner]
        heapq.heappush(g.future, entry)
        if time != INF:
            g.finite += count
        if owner != NO_OWNER:
            self._entries.setdefault(owner, []).append((g, entry))

    def promise(self, jobs: Iterable[int]) -> None:
        """Running jobs a waiting job will preempt later: no one else counts on them."""
        self.version += 1
        self.relied_on.update(jobs)

    def kill(self, job: int) -> None:
        """A running job's nodes went to a preemptor: its release is no one else's."""
        self.version += 1
        self.dead.add(job)
        for g, entry in self._entries.pop(job, []):
            if entry[0] != INF:
                g.finite -= int(entry[2])
            entry[2] = 0

    # -- decisions -----------------------------------------------------------------------------
    def place(self, groups: frozenset[str], n: int, end: float | None) -> tuple[str, ...]:
        """Take ``n`` nodes now (holes a job ending by ``end`` may use first); the caller
        checked :meth:`usable`."""
        chosen: list[str] = []
        left = n
        self.version += 1
        self._idle.clear()
        for g in self._ordered(groups):
            if left == 0:
                break
            from_holes = 0
            if end is not None and g.holes:
                for h in sorted(
                    (h for h in g.holes if h.deadline >= end), key=lambda h: h.deadline
                ):
                    use = min(h.count, left - from_holes)
                    h.count -= use
                    from_holes += use
                    if from_holes == left:
                        break
                g.holes = [h for h in g.holes if h.count > 0]
                self._holes_version += 1
            from_free = min(g.free, left - from_holes)
            g.free -= from_free
            take = from_holes + from_free
            chosen.extend(g.names[g.taken : g.taken + take])
            g.taken += take
            left -= take
            if from_free:
                # nodes from holes go back to their claimant; these come free at ``end``
                self._push(g, INF if end is None else end, from_free, NO_OWNER)
        chosen.sort(key=self.index.__getitem__)
        return tuple(chosen)

    def lendable(self, groups: frozenset[str], after: float) -> int:
        """Nodes free now, claimed or not by reservations with a known start at ``after`` or
        later: what a job that may be preempted for those reservations could start on now.
        (A reservation with no known start may need its nodes any moment.)"""
        return sum(
            g.free + self._holes_from(g, after) - self._holes_from(g, INF)
            for g in self._ordered(groups)
        )

    def place_lent(
        self, groups: frozenset[str], n: int, end: float | None, after: float
    ) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Take ``n`` nodes now: free ones first, then those of reservations starting at
        ``after`` or later, the latest first; the caller checked :meth:`lendable`. Returns
        the nodes and the jobs whose reservations lent some (they may preempt it)."""
        chosen: list[str] = []
        owners: set[int] = set()
        left = n
        self.version += 1
        self._idle.clear()
        for g in self._ordered(groups):
            use = min(g.free, left)
            g.free -= use
            take = use
            if left > take and g.holes:
                for h in sorted(g.holes, key=lambda h: -h.deadline):
                    if h.deadline == INF:
                        continue
                    if h.deadline < after or take == left:
                        break
                    lend = min(h.count, left - take)
                    h.count -= lend
                    take += lend
                    owners.add(h.owner)
                g.holes = [h for h in g.holes if h.count > 0]
                self._holes_version += 1
            chosen.extend(g.names[g.taken : g.taken + take])
            g.taken += take
            left -= take
            if use:
                # lent nodes stay their owner's: its reservation already counts their release
                self._push(g, INF if end is None else end, use, NO_OWNER)
            if left == 0:
                break
        chosen.sort(key=self.index.__getitem__)
        return tuple(chosen), tuple(sorted(owners))

    def claim_soon(self, groups: frozenset[str], n: int) -> list[int] | None:
        """Claim free and stopping nodes for a job that can start once those jobs have
        stopped; the stopping jobs it waits for, or None if they are not enough."""
        gs = self._ordered(groups)
        if sum(g.free + g.stopping_left for g in gs) < n:
            return None
        self.version += 1
        left = n
        for g in gs:
            use = min(g.free, left)
            g.free -= use
            left -= use
        waits: list[int] = []
        for g in gs:
            for s in g.stopping:
                if left == 0:
                    break
                use = min(s[1], left)
                if use:
                    s[1] -= use
                    g.stopping_left -= use
                    left -= use
                    waits.append(s[0])
        return sorted(set(waits))

    def claim_victims(
        self, groups: frozenset[str], n: int, victims: dict[int, dict[str, int]]
    ) -> None:
        """A preemptor claims free and stopping nodes, then its victims' nodes."""
        self.version += 1
        gs = self._ordered(groups)
        left = n
        for g in gs:
            use = min(g.free, left)
            g.free -= use
            left -= use
        for g in gs:
            for s in g.stopping:
                use = min(s[1], left)
                s[1] -= use
                g.stopping_left -= use
                left -= use
        for job in victims:
            self.kill(job)

    def reserve(
        self,
        groups: frozenset[str],
        n: int,
        duration: float | None,
        owner: int,
        hold_until: float | None = None,
    ) -> Reservation:
        """Reserve the earliest nodes to come free for a job that cannot start now; free
        nodes it takes become holes until its start (or ``hold_until`` if sooner)."""
        self.version += 1
        gs = self._ordered(groups)
        got: dict[int, int] = {}  # id(group) -> nodes
        start = self.now
        left = n
        for g in gs:
            use = min(g.free, left)
            if use:
                g.free -= use
                got[id(g)] = got.get(id(g), 0) + use
                left -= use
        free_taken = dict(got)
        if left:
            for g in gs:
                for s in g.stopping:
                    use = min(s[1], left)
                    if use:
                        s[1] -= use
                        g.stopping_left -= use
                        got[id(g)] = got.get(id(g), 0) + use
                        left -= use
                        start = max(start, self.soon)
        if left:
            # nodes it lent to a running job: its own again once it preempts that job
            reclaimed: set[int] = set()
            for g in gs:
                for job, lent, owners in g.lent:
                    if left == 0:
                        break
                    if owner not in owners or job in self.dead or not lent[0]:
                        continue
                    use = min(lent[0], left)
                    lent[0] -= use
                    got[id(g)] = got.get(id(g), 0) + use
                    left -= use
                    reclaimed.add(job)
                    start = max(start, self.soon)
            for job in reclaimed:
                self.kill(job)  # its release is not anyone else's to count on
                self.relied_on.add(job)
        consumed: list[tuple[Group, list[float], int]] = []
        if left and sum(g.finite for g in gs) < left:
            left = 0  # what comes free at known times is not enough: no known start
            start = INF
        while left:
            best: Group | None = None
            for g in gs:
                fut = g.future
                while fut and fut[0][2] <= 0:
                    heapq.heappop(fut)
                if fut and (best is None or fut[0][0] < best.future[0][0]):
                    best = g
            if best is None or best.future[0][0] == INF:
                start = INF
                break
            top = best.future[0]
            use = min(int(top[2]), left)
            top[2] -= use
            best.finite -= use
            left -= use
            consumed.append((best, top, use))
            got[id(best)] = got.get(id(best), 0) + use
            start = max(start, top[0])
        if start == INF:
            # it waits on a job with no known end: what comes free before is not its to hold
            for g, entry, use in consumed:
                entry[2] += use
                g.finite += use
        else:
            self.relied_on.update(int(e[3]) for _, e, _ in consumed if e[3] != NO_OWNER)
        deadline = start if hold_until is None else min(start, hold_until)
        for g in gs:
            taken = free_taken.get(id(g), 0)
            if taken:
                self._seq += 1
                g.holes.append(Hole(deadline, taken, owner, self._seq))
                self._holes_version += 1
            count = got.get(id(g), 0)
            if count and start != INF and duration is not None:
                self._push(g, start + duration, count, NO_OWNER)
        return Reservation(None if start == INF else start)
