"""What a GPU source reports: one :class:`GpuReading` per GPU, and the source protocol.

Kept apart from the sources so that the NVML source, the simulated source and the check
share one vocabulary without importing each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

# Clock event ("throttle") reason bits as NVML defines them (nvmlClocksEventReason* and the
# older nvmlClocksThrottleReason*, same values), with the names trainpod reports.
THROTTLE_BITS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clock",
    0x200: "board_limit",
    0x400: "reliability",
}

# The reasons that mean the GPU is being slowed by heat or by its power supply. sw_power_cap
# is left out on purpose: a busy data-centre GPU sits at its power cap most of the time.
DEFAULT_WARN_THROTTLE: frozenset[str] = frozenset(
    {"sw_thermal", "hw_thermal", "hw_slowdown", "hw_power_brake"}
)


def decode_throttle(mask: int) -> list[str]:
    """Names of the bits set in an NVML clock-event mask; unknown bits as ``"bit_0x..."``."""
    names = [name for bit, name in THROTTLE_BITS.items() if mask & bit]
    known = 0
    for bit in THROTTLE_BITS:
        known |= bit
    rest = mask & ~known
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"bit_{bit:#x}")
            rest &= ~bit
        bit <<= 1
    return names


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one moment. ``None`` means the GPU or driver does not report that value.

    ``index`` is the source's slot number (for NVML without an index list, the NVML index).
    ``lost`` means the GPU cannot be used: NVML says it is lost or needs a reset, or it
    could not be read at all; the other fields are then mostly ``None``. ``errors`` maps a
    field to the error that kept it from being read.
    """

    index: int
    name: str
    temperature_c: float | None = None
    power_w: float | None = None
    throttle_reasons: list[str] = field(default_factory=list)
    ecc_uncorrected_volatile: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    retired_pages_pending: bool | None = None
    lost: bool = False
    utilization_pct: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    pci_bus_id: str | None = None
    errors: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)


class GpuSource(Protocol):
    """Where GPU readings come from: real GPUs through NVML, or a simulated GPU.

    ``count()`` is how many GPUs the source sees now. ``read(i)`` must not raise for any
    ``i >= 0``: a GPU it cannot read (including one beyond ``count()``) is a reading with
    ``lost=True``. ``new_xids()`` returns each XID event once, as (GPU index, XID).
    """

    kind: str
    simulated: bool

    def count(self) -> int: ...

    def read(self, i: int) -> GpuReading: ...

    def new_xids(self) -> list[tuple[int, int]]: ...
