"""Energy and CO2e views: per job (``trainpod show``), per team, user and cluster.

Joules come from the store's ``energy`` table plus what the telemetry book has not written
yet; CO2e is energy (kWh) x the cluster's carbon intensity (the spec's ``carbon:``).
"""

from __future__ import annotations

import threading

from trainpod.api.devices import EnergyPart, EnergySummary, Footprint, JobEnergy
from trainpod.controller.config import ControllerConfig
from trainpod.controller.telemetry import TelemetryBook
from trainpod.controller.transitions import Transitions
from trainpod.store.energy import IDLE_JOB, Energy
from trainpod.store.repo import Store


class EnergyViews:
    def __init__(
        self,
        store: Store,
        cfg: ControllerConfig,
        tx: Transitions,
        lock: threading.RLock,
        telemetry: TelemetryBook,
    ) -> None:
        self.store = store
        self.cfg = cfg
        self.tx = tx
        self._lock = lock
        self.telemetry = telemetry

    def footprint(self, joules: float, simulated: bool) -> Footprint:
        kwh = joules / 3.6e6
        return Footprint(
            joules=joules,
            kwh=kwh,
            co2e_kg=kwh * self.cfg.carbon.g_per_kwh / 1000.0,
            simulated=simulated,
        )

    def job(self, job_id: int) -> JobEnergy:
        """The job's energy (NotFound for an unknown job)."""
        with self._lock:
            self.tx.job(job_id)
            rows = Energy(self.store).of_job(job_id)
            pending, pending_sim = self.telemetry.unflushed_by_job().get(job_id, (0.0, False))
        joules = sum(r.joules for r in rows) + pending
        simulated = any(r.simulated for r in rows) or pending_sim
        return JobEnergy(
            job_id=job_id,
            g_per_kwh=self.cfg.carbon.g_per_kwh,
            intensity_source=self.cfg.carbon.source,
            parts=[
                EnergyPart(attempt=r.attempt, node=r.node, joules=r.joules, simulated=r.simulated)
                for r in rows
            ],
            **self.footprint(joules, simulated).model_dump(),
        )

    def summary(self) -> EnergySummary:
        with self._lock:
            per_job = Energy(self.store).per_job()
            pending = self.telemetry.unflushed_by_job()
            owners = {
                j.id: (j.spec.get("team") or "none", j.spec.get("user") or "")
                for j in self.store.jobs_by_id([j for j in per_job if j != IDLE_JOB])
            }
        totals: dict[int, tuple[float, bool]] = {
            j: (e.joules, e.simulated) for j, e in per_job.items()
        }
        for j, (e, s) in pending.items():
            old, was = totals.get(j, (0.0, False))
            totals[j] = (old + e, was or s)
        teams: dict[str, tuple[float, bool]] = {}
        users: dict[str, tuple[float, bool]] = {}
        for j, (e, s) in totals.items():
            if j == IDLE_JOB:
                continue
            team, user = owners.get(j, ("unknown", "unknown"))
            for table, key in ((teams, team), (users, user)):
                old, was = table.get(key, (0.0, False))
                table[key] = (old + e, was or s)
        all_j = sum(e for e, _ in totals.values())
        idle = totals.get(IDLE_JOB, (0.0, False))
        return EnergySummary(
            g_per_kwh=self.cfg.carbon.g_per_kwh,
            intensity_source=self.cfg.carbon.source,
            cluster=self.footprint(all_j, any(s for _, s in totals.values())),
            idle=self.footprint(*idle),
            teams={k: self.footprint(*v) for k, v in sorted(teams.items())},
            users={k: self.footprint(*v) for k, v in sorted(users.items())},
        )
