"""Ended jobs' goodput, kept once computed (migration 11, ADR 0043).

An ended job's goodput stops changing once its last events are in (``FROZEN_AFTER_S`` after
it ended, :mod:`trainpod.controller.views`). ``/metrics`` computes it then, once, and keeps
it here instead of in the controller's memory: a team's sums are one SQL aggregate, a
restarted controller does not compute any of it again, and the collector keeps nothing per
job however long the history. Rows are added, never rewritten (a job counted twice would
count twice).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass, field

from trainpod.model.states import JobState
from trainpod.store.repo import Store

_ENDED = tuple(s.value for s in JobState if s.ended)


@dataclass(frozen=True)
class EndedGoodputRow:
    job_id: int
    team: str
    wall_s: float
    productive_s: float
    lost_s: dict[str, float] = field(default_factory=dict)  # cause -> seconds


@dataclass
class TeamGoodput:
    """A team's ended jobs together."""

    wall_s: float = 0.0
    productive_s: float = 0.0
    lost_s: dict[str, float] = field(default_factory=dict)


class EndedGoodput:
    """Typed access to the ``goodput_ended`` table (inside the store's transactions)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    @property
    def _conn(self) -> sqlite3.Connection:
        return self._store.connection

    def record(self, rows: Iterable[EndedGoodputRow]) -> list[int]:
        """Keep these jobs' goodput; returns the jobs newly kept (one already kept is left
        as it was, and not returned: the caller adds only these to its sums)."""
        kept = []
        for r in rows:
            cur = self._conn.execute(
                "INSERT OR IGNORE INTO goodput_ended (job_id, team, wall_s, productive_s, lost)"
                " VALUES (?, ?, ?, ?, ?)",
                (r.job_id, r.team, r.wall_s, r.productive_s, json.dumps(r.lost_s)),
            )
            if cur.rowcount:
                kept.append(r.job_id)
        return kept

    def by_team(self) -> dict[str, TeamGoodput]:
        """Every team's sums, in two aggregates (the lost seconds by cause from their JSON)."""
        out = {
            str(team): TeamGoodput(float(wall), float(productive))
            for team, wall, productive in self._conn.execute(
                "SELECT team, SUM(wall_s), SUM(productive_s) FROM goodput_ended GROUP BY team"
            )
        }
        for team, cause, seconds in self._conn.execute(
            "SELECT g.team, c.key, SUM(c.value) FROM goodput_ended g, json_each(g.lost) c"
            " GROUP BY g.team, c.key"
        ):
            out[str(team)].lost_s[str(cause)] = float(seconds)
        return out

    def uncounted(
        self,
        *,
        ended_by: float,
        ended_after: float | None = None,
        above_id: int = 0,
        limit: int | None = None,
    ) -> list[int]:
        """Ended jobs not kept yet that ended by ``ended_by`` (and after ``ended_after``: then
        the read is a range of the ``ended_at`` index, the jobs that ended since the last
        look; None: every ended job, a history being worked off, from the id after
        ``above_id`` on), oldest id first."""
        sql, args = self._uncounted("j.id", ended_by, ended_after)
        sql += " AND j.id > ? ORDER BY j.id"
        args.append(above_id)
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        return [int(r[0]) for r in self._conn.execute(sql, args)]

    def count_uncounted(self, *, ended_by: float, ended_after: float | None = None) -> int:
        sql, args = self._uncounted("COUNT(*)", ended_by, ended_after)
        return int(self._conn.execute(sql, args).fetchone()[0])

    @staticmethod
    def _uncounted(
        what: str, ended_by: float, ended_after: float | None
    ) -> tuple[str, list[object]]:
        # "+j.state": the state is checked on each row, never used to pick the index
        sql = (
            f"SELECT {what} FROM jobs j LEFT JOIN goodput_ended g ON g.job_id = j.id"
            f" WHERE +j.state IN ({','.join('?' * len(_ENDED))}) AND j.ended_at <= ?"
        )
        args: list[object] = [*_ENDED, ended_by]
        if ended_after is not None:
            sql += " AND j.ended_at > ?"
            args.append(ended_after)
        return sql + " AND g.job_id IS NULL", args
