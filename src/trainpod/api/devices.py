"""Device telemetry on the wire: what an agent reports per device, and what the controller
keeps and serves (``GET /v1/nodes/{name}/telemetry``).

A sample is the device at one moment, by the agent's clock. ``energy_j`` is a counter: the
joules the device used since the agent's source started counting (NVML's
``nvmlDeviceGetTotalEnergyConsumption`` since the driver loaded, or power integrated over
time by the agent where a device has no energy counter, or the simulated figure). Only its
deltas mean anything, and a counter that goes down means the source restarted.

``simulated`` is true for every sample of a simulated device (a CPU slot standing in for a
GPU on machines without one): its figures are plausible, not measured.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EnergySource = Literal["nvml", "integrated", "simulated"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeviceSample(_Model):
    """One device at one moment, as its agent read it."""

    index: int = Field(ge=0, description="the device's slot on its node (CUDA index)")
    name: str = ""
    t: float = Field(description="the agent's wall clock when it read the device")
    simulated: bool
    utilization_pct: float | None = Field(default=None, ge=0, le=100)
    memory_used_bytes: int | None = Field(default=None, ge=0)
    memory_total_bytes: int | None = Field(default=None, ge=0)
    power_w: float | None = Field(default=None, ge=0)
    temperature_c: float | None = None
    energy_j: float | None = Field(default=None, ge=0, description="a counter; see the module")
    energy_source: EnergySource = "integrated"
    xid_count: int = Field(default=0, ge=0, description="XIDs seen since the agent started")
    throttle_reasons: list[str] = Field(default_factory=list)


class TelemetryPoint(_Model):
    """One sample of a device, as ``GET /v1/nodes/{name}/telemetry`` serves it."""

    t: float
    utilization_pct: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    power_w: float | None
    temperature_c: float | None
    energy_j: float | None


class DeviceTelemetry(_Model):
    """A device of a node and its recent samples, oldest first."""

    index: int
    name: str
    simulated: bool
    samples: list[TelemetryPoint]


class EnergyPart(_Model):
    """Energy of one job attempt on one node."""

    attempt: int
    node: str
    joules: float
    simulated: bool


class Footprint(_Model):
    """Energy and its CO2e (energy x the cluster's carbon intensity)."""

    joules: float
    kwh: float
    co2e_kg: float
    simulated: bool = Field(description="some of the energy came from simulated devices")


class JobEnergy(Footprint):
    job_id: int
    g_per_kwh: float
    intensity_source: str
    parts: list[EnergyPart] = Field(default_factory=list)


class EnergySummary(_Model):
    """Energy and CO2e per team, user and the whole cluster (idle devices included)."""

    g_per_kwh: float
    intensity_source: str
    cluster: Footprint
    idle: Footprint
    teams: dict[str, Footprint]
    users: dict[str, Footprint]
