"""Energy used per job attempt and node, next to the rest of the cluster's state.

Rows are added to, never rewritten: :meth:`Energy.add` adds joules to a (job, attempt, node)
row. Job 0 holds what devices used while no job held them (idle). ``simulated`` is set on a
row as soon as any of its joules came from a simulated device.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass

from trainpod.store.repo import Store

IDLE_JOB = 0


@dataclass(frozen=True)
class EnergyRow:
    job_id: int
    attempt: int
    node: str
    joules: float
    simulated: bool


@dataclass(frozen=True)
class EnergyTotal:
    joules: float
    simulated: bool


class Energy:
    """Typed access to the energy table (inside the store's transactions)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    @property
    def _conn(self) -> sqlite3.Connection:
        return self._store.connection

    def add(self, rows: Iterable[EnergyRow], now: float) -> None:
        self._conn.executemany(
            "INSERT INTO energy (job_id, attempt, node, joules, simulated, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (job_id, attempt, node) DO UPDATE SET"
            " joules = joules + excluded.joules,"
            " simulated = MAX(simulated, excluded.simulated), updated_at = excluded.updated_at",
            [(r.job_id, r.attempt, r.node, r.joules, int(r.simulated), now) for r in rows],
        )

    def of_job(self, job_id: int) -> list[EnergyRow]:
        sql = "SELECT job_id, attempt, node, joules, simulated FROM energy WHERE job_id = ?"
        return [_row(r) for r in self._conn.execute(sql + " ORDER BY attempt, node", [job_id])]

    def per_job(self) -> dict[int, EnergyTotal]:
        """Job id -> its energy, every attempt and node together (job 0: idle devices)."""
        sql = "SELECT job_id, SUM(joules), MAX(simulated) FROM energy GROUP BY job_id"
        return {int(j): EnergyTotal(float(e), bool(s)) for j, e, s in self._conn.execute(sql)}

    def of_jobs(self, job_ids: Iterable[int]) -> dict[int, EnergyTotal]:
        """:meth:`per_job` for these jobs only (those without energy left out)."""
        sql = (
            "SELECT e.job_id, SUM(e.joules), MAX(e.simulated) FROM energy e"
            " JOIN json_each(?) i ON e.job_id = i.value GROUP BY e.job_id"
        )
        rows = self._conn.execute(sql, (json.dumps(list(job_ids)),))
        return {int(j): EnergyTotal(float(e), bool(s)) for j, e, s in rows}

    def per_team(self) -> dict[str | None, EnergyTotal]:
        """Jobs' energy by their spec's team (None: a job without one; job 0 left out), in
        one aggregate. A job no longer in the store is under ``"unknown"``."""
        sql = (
            "SELECT CASE WHEN j.id IS NULL THEN 'unknown' ELSE json_extract(j.spec, '$.team')"
            " END, SUM(e.joules), MAX(e.simulated) FROM energy e"
            " LEFT JOIN jobs j ON j.id = e.job_id WHERE e.job_id != ? GROUP BY 1"
        )
        rows = self._conn.execute(sql, (IDLE_JOB,))
        return {t: EnergyTotal(float(e), bool(s)) for t, e, s in rows}

    def total(self) -> EnergyTotal:
        """Every row together, idle devices' included."""
        row = self._conn.execute("SELECT SUM(joules), MAX(simulated) FROM energy").fetchone()
        return EnergyTotal(float(row[0] or 0.0), bool(row[1]))


def _row(r: tuple[int, int, str, float, int]) -> EnergyRow:
    return EnergyRow(int(r[0]), int(r[1]), str(r[2]), float(r[3]), bool(r[4]))
