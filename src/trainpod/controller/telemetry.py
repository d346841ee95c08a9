"""Device telemetry and energy on the controller: a bounded ring of samples per device,
and each device's energy attributed to the job attempt holding its node.

:meth:`TelemetryBook.record` is where the heartbeat's ``telemetry`` field is read (called
once per heartbeat by :class:`~trainpod.controller.intake.HeartbeatIngest`). The rings are
memory only (the last RING samples of each device, evicted when the node goes away); the
energy is durable: deltas of each device's energy counter are summed in memory per (job,
attempt, node) and written to the store's ``energy`` table at most every FLUSH_S seconds
(and when asked), so a restarted controller keeps what was written. A counter that goes
down (the agent or the driver restarted) starts afresh: that interval's energy is lost,
never counted twice.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from trainpod.api.devices import DeviceSample, DeviceTelemetry, TelemetryPoint
from trainpod.store.energy import IDLE_JOB, Energy, EnergyRow
from trainpod.store.repo import Store

RING = 120  # samples kept per device: two minutes at one beat a second
FLUSH_S = 5.0


@dataclass(frozen=True)
class Holder:
    """Who a node's devices worked for when a sample came: a job's attempt, or no one."""

    job_id: int = IDLE_JOB
    attempt: int = 0


@dataclass
class TelemetryBook:
    store: Store
    ring: int = RING
    flush_s: float = FLUSH_S
    rings: dict[str, dict[int, deque[DeviceSample]]] = field(default_factory=dict, init=False)
    _pending: dict[tuple[int, int, str], tuple[float, bool]] = field(
        default_factory=dict, init=False
    )
    _flushed_at: float | None = field(default=None, init=False)

    def record(self, node: str, samples: list[DeviceSample], holder: Holder, now: float) -> None:
        """Keep the node's new samples; give the energy since each device's last sample to
        ``holder``. A sample no newer than the device's last one is a repeat and is skipped."""
        devices = self.rings.setdefault(node, {})
        for s in samples:
            ring = devices.get(s.index)
            if ring is None:
                ring = devices[s.index] = deque(maxlen=self.ring)
            prev = ring[-1] if ring else None
            if prev is not None and s.t <= prev.t:
                continue
            ring.append(s)
            if prev is None or prev.energy_j is None or s.energy_j is None:
                continue
            joules = s.energy_j - prev.energy_j
            if joules > 0:
                key = (holder.job_id, holder.attempt, node)
                old, sim = self._pending.get(key, (0.0, False))
                self._pending[key] = (old + joules, sim or s.simulated)

    def flush(self, now: float, force: bool = False) -> None:
        """Write the energy summed since the last flush (at most every ``flush_s``)."""
        if not self._pending:
            return
        if not force and self._flushed_at is not None and now - self._flushed_at < self.flush_s:
            return
        rows = [EnergyRow(j, a, n, e, s) for (j, a, n), (e, s) in self._pending.items()]
        Energy(self.store).add(rows, now)
        self._pending.clear()
        self._flushed_at = now

    def unflushed(self, job_id: int) -> float:
        """Joules of the job not written yet (a view adds them to the stored ones)."""
        return sum(e for (j, _, _), (e, _) in self._pending.items() if j == job_id)

    def unflushed_by_job(self) -> dict[int, tuple[float, bool]]:
        """Job id -> (joules not written yet, any simulated), for a scrape."""
        out: dict[int, tuple[float, bool]] = {}
        for (j, _, _), (e, sim) in self._pending.items():
            old, was = out.get(j, (0.0, False))
            out[j] = (old + e, was or sim)
        return out

    def forget(self, node: str) -> None:
        self.rings.pop(node, None)

    def keep_only(self, nodes: set[str]) -> None:
        """Evict the rings of nodes that went away (stopped, retired, removed)."""
        for gone in set(self.rings) - nodes:
            del self.rings[gone]

    def latest(self) -> dict[str, list[DeviceSample]]:
        """Each node's devices' newest samples (for a scrape)."""
        return {
            node: [ring[-1] for _, ring in sorted(devices.items()) if ring]
            for node, devices in self.rings.items()
        }

    def of(self, node: str) -> list[DeviceTelemetry]:
        out = []
        for index, ring in sorted(self.rings.get(node, {}).items()):
            if not ring:
                continue
            last = ring[-1]
            points = [
                TelemetryPoint(
                    t=s.t,
                    utilization_pct=s.utilization_pct,
                    memory_used_bytes=s.memory_used_bytes,
                    memory_total_bytes=s.memory_total_bytes,
                    power_w=s.power_w,
                    temperature_c=s.temperature_c,
                    energy_j=s.energy_j,
                )
                for s in ring
            ]
            out.append(
                DeviceTelemetry(
                    index=index, name=last.name, simulated=last.simulated, samples=points
                )
            )
        return out
