"""The GPU health check, over any :class:`GpuSource` (real NVML or a simulated GPU).

Verdicts:

* FAULT: a node-fault XID, volatile uncorrectable ECC errors, a row-remap failure, a lost
  GPU, or a GPU count other than expected. Faults are sticky: XIDs are edge-triggered
  events, and a GPU that failed once is not trusted again until :meth:`GpuCheck.reset`
  (called after repair and a passing deep check).
* WARN: thermal or power throttling, a temperature above ``temp_warn_c``, a pending row
  remap or page retirement (a reset applies it), an application or unknown XID. Not sticky.

With a simulated source every reason starts with ``"simulated GPU: "``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from trainpod.agent.health.base import CheckResult, HealthCheck, Status
from trainpod.agent.health.nvml import GpuUnavailable, NvmlSource
from trainpod.agent.health.readings import (
    DEFAULT_WARN_THROTTLE,
    GpuReading,
    GpuSource,
    decode_throttle,
)
from trainpod.agent.health.simgpu import (
    SimulatedSource,
    SimulatedStateError,
    clear,
    inject,
    simulated_faults,
)
from trainpod.agent.health.xid import classify_xid, describe_xid, xid_status

__all__ = [
    "DEFAULT_WARN_THROTTLE",
    "GpuCheck",
    "GpuReading",
    "GpuSource",
    "GpuUnavailable",
    "NvmlSource",
    "SimulatedSource",
    "SimulatedStateError",
    "clear",
    "decode_throttle",
    "inject",
    "simulated_faults",
]

SIMULATED_PREFIX = "simulated GPU: "
_HISTORY = 100  # XIDs kept in the facts since the last reset


class GpuCheck(HealthCheck):
    """Checks ``expected_count`` GPUs of ``source``. Blocking, cheap; not thread-safe."""

    name: ClassVar[str] = "gpu"

    def __init__(
        self,
        source: GpuSource,
        expected_count: int,
        *,
        temp_warn_c: float = 85.0,
        warn_throttle: frozenset[str] = DEFAULT_WARN_THROTTLE,
    ) -> None:
        self.source = source
        self.expected_count = expected_count
        self.temp_warn_c = temp_warn_c
        self.warn_throttle = warn_throttle
        self._sticky: dict[tuple[str, int], str] = {}
        self._xid_history: list[dict[str, Any]] = []

    def reset(self) -> None:
        """Forget the sticky faults and XID history (after repair and a deep check)."""
        self._sticky.clear()
        self._xid_history.clear()

    def run(self) -> CheckResult:
        count = self.source.count()
        readings = [self.source.read(i) for i in range(max(count, self.expected_count))]
        xids = self.source.new_xids()
        faults: dict[tuple[str, int], str] = {}
        warns: list[str] = []
        if count != self.expected_count:
            diff = self.expected_count - count
            detail = f"{diff} missing" if diff > 0 else f"{-diff} more than expected"
            faults[("count", -1)] = f"expected {self.expected_count} GPUs, found {count} ({detail})"
        for reading in readings:
            self._judge(reading, faults, warns)
        xid_facts = []
        for gpu, xid in xids:
            info = classify_xid(xid)
            xid_facts.append(
                {"gpu": gpu, "xid": xid, "kind": info.kind.value, "meaning": info.meaning}
            )
            text = f"GPU {gpu}: {describe_xid(xid)}"
            if xid_status(xid) is Status.FAULT:
                faults[(f"xid{xid}", gpu)] = text
            else:
                warns.append(text)
        self._xid_history = (self._xid_history + xid_facts)[-_HISTORY:]
        self._sticky.update(faults)
        fault_reasons = list(self._sticky.values())
        if fault_reasons:
            status, parts = Status.FAULT, fault_reasons + warns
        elif warns:
            status, parts = Status.WARN, warns
        else:
            status, parts = Status.OK, [f"{count} GPUs healthy"]
        reason = "; ".join(parts)
        if self.source.simulated:
            reason = SIMULATED_PREFIX + reason
        facts = {
            "source": self.source.kind,
            "count": count,
            "expected_count": self.expected_count,
            "readings": [r.to_dict() for r in readings],
            "xids": xid_facts,
            "xid_history": list(self._xid_history),
            "sticky_faults": fault_reasons,
        }
        return CheckResult(self.name, status, reason, facts, simulated=self.source.simulated)

    def _judge(self, r: GpuReading, faults: dict[tuple[str, int], str], warns: list[str]) -> None:
        i = r.index
        if r.lost:
            faults[("lost", i)] = f"GPU {i} lost (fallen off the bus, or not responding)"
            return
        if r.ecc_uncorrected_volatile:
            faults[("ecc", i)] = (
                f"GPU {i}: {r.ecc_uncorrected_volatile} uncorrectable ECC errors (volatile)"
            )
        if r.remap_failure:
            faults[("remap", i)] = f"GPU {i}: row remapping failed (memory is failing)"
        if r.remap_pending:
            warns.append(f"GPU {i}: row remap pending (a GPU reset applies it)")
        if r.retired_pages_pending:
            warns.append(f"GPU {i}: pages pending retirement (a reboot retires them)")
        throttled = [t for t in r.throttle_reasons if t in self.warn_throttle]
        if throttled:
            warns.append(f"GPU {i}: throttled ({', '.join(throttled)})")
        if r.temperature_c is not None and r.temperature_c > self.temp_warn_c:
            warns.append(f"GPU {i}: {r.temperature_c:g} C, above {self.temp_warn_c:g} C")
