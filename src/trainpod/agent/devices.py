"""Device telemetry: what the agent reads from each device for every heartbeat.

Two readers behind one protocol:

* :class:`NvmlReader` reads real GPUs through NVML (the ``pynvml`` module of
  ``nvidia-ml-py``, via :class:`~trainpod.agent.health.nvml.NvmlSource`): utilisation,
  memory, power, temperature, throttle reasons, XIDs, and the energy counter
  (``nvmlDeviceGetTotalEnergyConsumption``) where the device has one.
* :class:`SimulatedReader` stands in on machines without GPUs. Its figures are SIMULATED:
  plausible values for a data-centre GPU that follow whether a rank runs on the device
  (busy: ~90 % utilisation, ~600 W; idle: 0 %, ~70 W), and the faults injected in the
  simulated GPU's state file (temperature, thermal throttling, XIDs). Every sample it makes
  says ``simulated=True``.

:class:`DeviceTelemetry` makes the samples: at most one reading per ``min_interval_s``
(a burst of heartbeats reuses the last one), and where a device has no energy counter it
integrates power over time (trapezoids between readings), so ``energy_j`` is always a
counter in joules since the agent started.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from trainpod.agent.health.nvml import GpuUnavailable, NvmlSource
from trainpod.agent.health.readings import GpuReading
from trainpod.agent.health.simgpu import DEFAULT_TEMPERATURE_C, load_state
from trainpod.api.devices import DeviceSample, EnergySource

log = logging.getLogger(__name__)

MIB = 2**20
GIB = 2**30
SIM_MEMORY_TOTAL = 80 * GIB
SIM_IDLE_W = 70.0
SIM_BUSY_W = 610.0  # plus a wobble of a few watts; an H100 SXM's cap is 700 W


class DeviceReader(Protocol):
    """Reads the devices of a node. ``busy`` is the slots a running rank uses (for the
    simulated reader; a real one measures)."""

    simulated: bool

    def read(self, busy: set[int]) -> list[tuple[GpuReading, float | None, int]]:
        """Per device: its reading, its energy counter in joules (None: it has none) and
        the XIDs it reported since the last call."""
        ...


class NvmlReader:
    """Real GPUs through NVML; one per agent (its own NVML event set for XIDs)."""

    simulated = False

    def __init__(self, source: NvmlSource) -> None:
        self._source = source

    def read(self, busy: set[int]) -> list[tuple[GpuReading, float | None, int]]:
        xids: dict[int, int] = {}
        for gpu, _xid in self._source.new_xids():
            xids[gpu] = xids.get(gpu, 0) + 1
        src = self._source
        return [(src.read(i), src.energy_j(i), xids.get(i, 0)) for i in range(src.slots)]


class SimulatedReader:
    """SIMULATED GPUs (CPU slots): figures that follow whether a rank runs on the slot."""

    simulated = True

    def __init__(
        self, count: int, state_file: Path | None, clock: Callable[[], float] = time.time
    ) -> None:
        self._count = count
        self._state_file = state_file
        self._clock = clock
        self._xids_seen = 0
        self._epoch: object = None

    def read(self, busy: set[int]) -> list[tuple[GpuReading, float | None, int]]:
        state = load_state(self._state_file) if self._state_file is not None else {}
        xids = self._new_xids(state)
        now = self._clock()
        out: list[tuple[GpuReading, float | None, int]] = []
        for i in range(self._count):
            key = str(i)
            on = i in busy
            wobble = math.sin(now / 7.0 + i)  # deterministic, so two reads a second apart differ
            util = 90.0 + 6.0 * wobble if on else 0.0
            thermal = bool(state.get("thermal", {}).get(key, False))
            default_c = DEFAULT_TEMPERATURE_C + (30.0 + 2.0 * wobble if on else 0.0)
            reading = GpuReading(
                index=i,
                name="SIMULATED GPU (CPU slot)",
                temperature_c=float(state.get("temperature_c", {}).get(key, default_c)),
                power_w=(SIM_BUSY_W + 20.0 * wobble) if on else SIM_IDLE_W,
                throttle_reasons=["sw_thermal", "hw_thermal"] if thermal else [],
                utilization_pct=util,
                memory_used_mib=(60 * GIB if on else GIB // 2) / MIB,
                memory_total_mib=SIM_MEMORY_TOTAL / MIB,
            )
            out.append((reading, None, xids.get(i, 0)))
        return out

    def _new_xids(self, state: dict[str, object]) -> dict[int, int]:
        epoch = state.get("epoch")
        if epoch != self._epoch:
            self._epoch, self._xids_seen = epoch, 0
        events = state.get("xids", [])
        assert isinstance(events, list)
        new = events[self._xids_seen :]
        self._xids_seen = len(events)
        counts: dict[int, int] = {}
        for e in new:
            counts[int(e["gpu"])] = counts.get(int(e["gpu"]), 0) + 1
        return counts


class DeviceTelemetry:
    """Samples for the heartbeat: at most one reading per ``min_interval_s``; energy as a
    counter (the device's own, else power integrated over time); XIDs counted since start.
    Never raises: a reader that fails is logged and the heartbeat goes without samples."""

    def __init__(
        self,
        reader: DeviceReader,
        *,
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._reader = reader
        self._min_interval = min_interval_s
        self._clock = clock
        self._last: list[DeviceSample] = []
        self._last_t: float | None = None
        self._integrated: dict[int, float] = {}
        self._xids: dict[int, int] = {}

    def samples(self, busy: set[int]) -> list[DeviceSample]:
        now = self._clock()
        if self._last_t is not None and now - self._last_t < self._min_interval:
            return self._last
        try:
            readings = self._reader.read(busy)
        except Exception as exc:  # telemetry must never stop the heartbeat
            log.warning("device telemetry unavailable: %s", exc)
            return []
        previous = {s.index: s for s in self._last}
        out = []
        for reading, counter, new_xids in readings:
            i = reading.index
            self._xids[i] = self._xids.get(i, 0) + new_xids
            source: EnergySource
            energy: float | None
            if counter is not None:
                energy, source = counter, "nvml"
            else:
                energy = self._integrate(i, reading.power_w, previous.get(i), now)
                source = "simulated" if self._reader.simulated else "integrated"
            out.append(_sample(reading, now, self._reader.simulated, energy, source, self._xids[i]))
        self._last, self._last_t = out, now
        return out

    def _integrate(
        self, i: int, power_w: float | None, prev: DeviceSample | None, now: float
    ) -> float | None:
        if power_w is None:
            return self._integrated.get(i)
        total = self._integrated.get(i, 0.0)
        if prev is not None and prev.power_w is not None:
            total += (prev.power_w + power_w) / 2.0 * max(0.0, now - prev.t)
        self._integrated[i] = total
        return total


def _sample(
    r: GpuReading, t: float, simulated: bool, energy: float | None, source: EnergySource, xids: int
) -> DeviceSample:
    def _bytes(mib: float | None) -> int | None:
        return None if mib is None else int(mib * MIB)

    util = r.utilization_pct
    return DeviceSample(
        index=r.index,
        name=r.name,
        t=t,
        simulated=simulated,
        utilization_pct=None if util is None else min(100.0, max(0.0, util)),
        memory_used_bytes=_bytes(r.memory_used_mib),
        memory_total_bytes=_bytes(r.memory_total_mib),
        power_w=r.power_w,
        temperature_c=r.temperature_c,
        energy_j=energy,
        energy_source=source,
        xid_count=xids,
        throttle_reasons=list(r.throttle_reasons),
    )


def device_reader(devices: int, gpus: list[str], gpu_state: Path | None) -> DeviceReader | None:
    """NVML for a node with GPUs (None, logged, if NVML will not start there), else the
    SIMULATED reader for its CPU slots."""
    if not gpus:
        return SimulatedReader(devices, gpu_state)
    try:
        return NvmlReader(NvmlSource([int(g) for g in gpus], kmsg=None))
    except GpuUnavailable as exc:
        log.warning("no device telemetry: %s", exc)
        return None
