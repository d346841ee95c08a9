"""Which health checks a node runs, wired from its spec."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainpod.agent.health import (
    ClockCheck,
    DiskCheck,
    GpuCheck,
    HealthCheck,
    MemoryCheck,
    NvmlSource,
    ReachabilityCheck,
    SimulatedSource,
)
from trainpod.agent.health.gpu import GpuSource


def build_checks(
    *,
    devices: int,
    gpus: list[str],
    gpu_state: Path | None,
    scratch: Path,
    shared: Path,
    quota_gib: float | None,
    min_free_gib: float,
    max_temperature_c: float,
    controller: tuple[str, int],
    reference: Callable[[], float | None],
) -> list[HealthCheck]:
    """GPU (NVML on real GPUs, else the simulated GPU), disk, memory, clock, network."""
    checks: list[HealthCheck] = []
    if devices > 0:
        source: GpuSource
        if gpus:
            source = NvmlSource([int(g) for g in gpus])
        else:
            assert gpu_state is not None
            source = SimulatedSource(gpu_state, devices)
        checks.append(GpuCheck(source, devices, temp_warn_c=max_temperature_c))
    quota = {"scratch": quota_gib} if quota_gib else None
    checks.append(
        DiskCheck(
            {"scratch": scratch, "shared": shared}, min_free_gib=min_free_gib, quota_gib=quota
        )
    )
    checks.append(MemoryCheck())
    checks.append(ClockCheck(reference))
    checks.append(ReachabilityCheck({"controller": controller}))
    return checks
