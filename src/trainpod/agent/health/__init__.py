"""Node health checks: one module per check behind :class:`HealthCheck`.

The agent wires the checks it wants and calls :func:`run_checks`. Nothing here imports
torch: the deep check runs it in subprocesses (:func:`run_deep_check`).

``run_deep_check`` is imported on first use, so that ``python -m trainpod.agent.health.deep``
does not find its own module already imported by this package.
"""

from typing import TYPE_CHECKING, Any

from trainpod.agent.health.base import CheckResult, HealthCheck, Status, run_checks, worst
from trainpod.agent.health.clock import ClockCheck
from trainpod.agent.health.disk import DiskCheck, fill, unfill
from trainpod.agent.health.gpu import (
    GpuCheck,
    GpuReading,
    GpuSource,
    GpuUnavailable,
    NvmlSource,
    SimulatedSource,
    SimulatedStateError,
    clear,
    inject,
    simulated_faults,
)
from trainpod.agent.health.memory import MemoryCheck
from trainpod.agent.health.network import ReachabilityCheck
from trainpod.agent.health.xid import (
    XidEvent,
    XidInfo,
    XidKind,
    classify_xid,
    parse_kernel_xids,
    xid_status,
)

if TYPE_CHECKING:
    from trainpod.agent.health.deep import run_deep_check


def __getattr__(name: str) -> Any:
    if name == "run_deep_check":
        from trainpod.agent.health.deep import run_deep_check

        return run_deep_check
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckResult",
    "ClockCheck",
    "DiskCheck",
    "GpuCheck",
    "GpuReading",
    "GpuSource",
    "GpuUnavailable",
    "HealthCheck",
    "MemoryCheck",
    "NvmlSource",
    "ReachabilityCheck",
    "SimulatedSource",
    "SimulatedStateError",
    "Status",
    "XidEvent",
    "XidInfo",
    "XidKind",
    "classify_xid",
    "clear",
    "fill",
    "inject",
    "parse_kernel_xids",
    "run_checks",
    "run_deep_check",
    "simulated_faults",
    "unfill",
    "worst",
    "xid_status",
]
