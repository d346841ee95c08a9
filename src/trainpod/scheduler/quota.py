"""Teams' quotas per partition, with borrowing (Kueue's cohorts, HyperPod's task governance).

A team may hold up to its quota of nodes in a partition at once. Beyond it, it borrows: only
if it may borrow, within its borrowing limit, and out of the idle quota of teams that lend
(quota neither used nor asked for by their own queued jobs), plus the partition's nodes in
no team's quota, less what other teams already borrow. A running job counts until it has
ended, stopping ones included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from trainpod.scheduler.policy import SharingPolicy

Key = tuple[str, str]  # (team, partition)


class Quotas:
    def __init__(
        self,
        policy: SharingPolicy,
        held: Iterable[tuple[str, str, int]],
        capacity: Mapping[str, int],
        wanted: Iterable[tuple[str, str, int]] = (),
    ) -> None:
        """``held``: (team, partition, nodes) of every running job; ``capacity``: the nodes
        of each partition; ``wanted``: the same of every queued job. A team's quota that its
        own queued jobs ask for (those that fit in it) is not idle, so it is not lent: a
        borrower does not take nodes that their owner waits for and would only reclaim."""
        self.teams = {t.name: t for t in policy.teams}
        self.active = bool(self.teams)  # no teams: no quotas
        self.version = 0  # bumped by every change
        self.used: dict[str, dict[str, int]] = {}  # partition -> team -> nodes
        for team, part, nodes in held:
            per = self.used.setdefault(part, {})
            per[team] = per.get(team, 0) + nodes
        self.wanted: dict[Key, int] = {}
        for (team, part, nodes), jobs in Counter(wanted).items():
            if nodes <= self.quota(team, part):  # a job that must borrow reserves no quota
                key = (team, part)
                self.wanted[key] = self.wanted.get(key, 0) + nodes * jobs
        self._refusals: dict[tuple[str, str, int], str | None] = {}
        self._borrowing: dict[Key, bool] = {}
        """(team, partition, nodes) -> refusal with nothing given back, until usage changes."""
        self.unassigned = {
            part: max(0, cap - sum(t.quota_in(part) for t in policy.teams))
            for part, cap in capacity.items()
        }

    def quota(self, team: str, part: str) -> int:
        t = self.teams.get(team)
        return 0 if t is None else t.quota_in(part)

    def used_by(self, team: str, part: str, minus: Mapping[Key, int] | None = None) -> int:
        used = self.used.get(part, {}).get(team, 0)
        return used - (minus or {}).get((team, part), 0)

    def add(self, team: str, part: str, nodes: int) -> None:
        """A queued job of the team starts: its nodes move from wanted to used."""
        self.version += 1
        self._refusals.clear()
        self._borrowing.clear()
        key = (team, part)
        if key in self.wanted:
            self.wanted[key] = max(0, self.wanted[key] - nodes)
        per = self.used.setdefault(part, {})
        per[team] = per.get(team, 0) + nodes

    def within(self, team: str, part: str, nodes: int) -> bool:
        """Would ``nodes`` more keep the team inside its own quota?"""
        return self.active and self.used_by(team, part) + nodes <= self.quota(team, part)

    def borrowing(self, team: str, part: str, minus: Mapping[Key, int] | None = None) -> bool:
        """Does the team hold more than its quota (its excess is others' idle share)?"""
        if minus:
            return self.used_by(team, part, minus) > self.quota(team, part)
        key = (team, part)
        got = self._borrowing.get(key)
        if got is None:
            got = self._borrowing[key] = self.used_by(team, part) > self.quota(team, part)
        return got

    def refusal(
        self,
        team: str,
        part: str,
        nodes: int,
        minus: Mapping[Key, int] | None = None,
        back: Mapping[Key, int] | None = None,
    ) -> str | None:
        """Why ``nodes`` more for the team would break the quota rules (None: they would
        not), with the nodes in ``minus`` already given back; ``back``: of those, the nodes
        of jobs that go back to the queue (preempted) and want their team's quota again."""
        if minus or back:
            return self._refusal(team, part, nodes, minus, back)
        key = (team, part, nodes)
        if key not in self._refusals:
            self._refusals[key] = self._refusal(team, part, nodes, None, None)
        return self._refusals[key]

    def wants_back(self, team: str, part: str, nodes: int) -> int:
        """The quota a preempted job of ``nodes`` asks for again once queued: all of it if
        it fits its team's quota, none if it must borrow (as for the queue: ``wanted``)."""
        return nodes if nodes <= self.quota(team, part) else 0

    def _refusal(
        self,
        team: str,
        part: str,
        nodes: int,
        minus: Mapping[Key, int] | None,
        back: Mapping[Key, int] | None = None,
    ) -> str | None:
        t = self.teams.get(team)
        if t is None:
            return None if not self.active else f"team {team} has no quota"
        used = self.used_by(team, part, minus)
        quota = t.quota_in(part)
        need = used + nodes - quota
        if need <= 0:
            return None
        where = f"team {team} uses {used} of its {quota} nodes in partition {part or '-'}"
        if not t.borrow:
            return f"waiting for quota: {where} (may not borrow)"
        if t.borrow_limit is not None and need > t.borrow_limit:
            return (
                f"waiting for quota: {where}; it may borrow {t.borrow_limit} beyond it"
                f" and this job needs {nodes}"
            )
        pool = self.lendable(team, part, minus, back)
        if need > pool:
            return (
                f"waiting for quota: {where}; other teams have {max(pool, 0)} idle nodes"
                f" to lend and this job needs {nodes}"
            )
        return None

    def lendable(
        self,
        team: str,
        part: str,
        minus: Mapping[Key, int] | None = None,
        back: Mapping[Key, int] | None = None,
    ) -> int:
        """Nodes ``team`` could borrow in ``part``: others' idle lent quota (neither used
        nor wanted by their queued jobs, nor by jobs going back to the queue: ``back``) and
        the nodes in no quota, less what other teams borrow already."""
        pool = self.unassigned.get(part, 0)
        for other in self.teams.values():
            if other.name != team and other.lend:
                key = (other.name, part)
                idle = other.quota_in(part) - self.used_by(other.name, part, minus)
                wanted = self.wanted.get(key, 0) + (back or {}).get(key, 0)
                pool += max(0, idle - wanted)
        for other_name in self.used.get(part, {}):
            if other_name != team:
                pool -= max(0, self.used_by(other_name, part, minus) - self.quota(other_name, part))
        return pool
