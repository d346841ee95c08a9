"""Real GPUs through NVML (the ``pynvml`` module of the ``nvidia-ml-py`` package).

``pynvml`` is imported when a source is built, never at import time, so this module loads on
machines without a driver. XIDs come from two places, merged and de-duplicated per call:

* an NVML event set registered for ``nvmlEventTypeXidCriticalError`` on every GPU, drained
  without blocking (``nvmlEventSetWait`` with a 0 ms timeout);
* the kernel log (``/dev/kmsg``) when readable, read without blocking from the end of the
  log as it was when the source was built (history is skipped: after a restart the agent
  relies on the GPUs' state, not on old log lines), mapped to a GPU by PCI bus id.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainpod.agent.health.readings import GpuReading, decode_throttle
from trainpod.agent.health.xid import parse_kernel_xids, pci_key
from trainpod.errors import Fatal

log = logging.getLogger(__name__)

MIB = 2**20
_MAX_EVENTS = 1024  # per new_xids() call, so a storm of events cannot stall the agent


class GpuUnavailable(Fatal):
    """NVML cannot be used here: no pynvml, no driver, or no NVIDIA library."""


class NvmlSource:
    """GPU readings and XIDs from NVML. Not thread-safe; one per agent.

    ``indices`` selects NVML device indices (default: all); slot ``i`` of this source is
    ``indices[i]``. ``nvml`` replaces the ``pynvml`` module (for tests); ``kmsg`` is the
    kernel log to follow, None to skip it. Raises :class:`GpuUnavailable` when NVML cannot
    be initialised. Call :meth:`close` (or use ``with``) to release NVML.
    """

    kind = "nvml"
    simulated = False

    def __init__(
        self,
        indices: list[int] | None = None,
        *,
        nvml: Any = None,
        kmsg: Path | None = Path("/dev/kmsg"),
    ) -> None:
        self._nvml = nvml if nvml is not None else _import_pynvml()
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            raise GpuUnavailable(
                f"NVML could not start: {exc}. Install or load the NVIDIA driver, or use "
                "SimulatedSource on a machine without GPUs"
            ) from exc
        self._closed = False
        total = self._device_count()
        self._indices = list(range(total)) if indices is None else list(indices)
        self._handles: dict[int, Any] = {}
        self._pci: dict[int, str] = {}
        self.event_errors: dict[int, str] = {}
        self._events: Any = None
        try:
            self._events = self._nvml.nvmlEventSetCreate()
        except self._nvml.NVMLError as exc:  # XIDs then come from the kernel log only
            log.warning("NVML event set unavailable: %s", exc)
        for slot, index in enumerate(self._indices):
            self._open(slot, index)
        self._kmsg_fd = _open_kmsg(kmsg)

    def _device_count(self) -> int:
        try:
            return int(self._nvml.nvmlDeviceGetCount())
        except self._nvml.NVMLError:
            return 0

    def _open(self, slot: int, index: int) -> None:
        nv = self._nvml
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as exc:
            log.warning("GPU %d (NVML index %d) has no handle: %s", slot, index, exc)
            return
        self._handles[slot] = handle
        try:
            self._pci[slot] = _text(nv.nvmlDeviceGetPciInfo(handle).busId)
        except nv.NVMLError as exc:
            log.warning("GPU %d: no PCI bus id: %s", slot, exc)
        if self._events is None:
            self.event_errors[slot] = "no NVML event set"
            return
        try:
            nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, self._events)
        except nv.NVMLError as exc:  # e.g. not supported: the kernel log still has XIDs
            self.event_errors[slot] = str(exc)

    @property
    def kmsg_readable(self) -> bool:
        """Whether XIDs are also read from the kernel log."""
        return self._kmsg_fd is not None

    def count(self) -> int:
        """How many of the selected GPUs NVML enumerates now."""
        total = self._device_count()
        return sum(1 for index in self._indices if index < total)

    @property
    def slots(self) -> int:
        """How many GPUs were selected (``read`` takes 0 .. slots - 1)."""
        return len(self._indices)

    def energy_j(self, i: int) -> float | None:
        """GPU slot ``i``'s energy counter in joules (NVML: millijoules since the driver
        loaded; Volta and later); None where the device or driver has none."""
        handle = self._handles.get(i)
        if handle is None:
            return None
        try:
            return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(handle)) / 1000.0
        except self._nvml.NVMLError:
            return None

    def read(self, i: int) -> GpuReading:
        """Read GPU slot ``i``. Never raises; an unreadable GPU is ``lost``."""
        handle = self._handles.get(i)
        if handle is None:
            return GpuReading(index=i, name="unknown", lost=True, errors={"handle": "no handle"})
        nv = self._nvml
        values: dict[str, Any] = {"pci_bus_id": self._pci.get(i)}
        errors: dict[str, str] = {}
        lost_codes = {nv.NVML_ERROR_GPU_IS_LOST, nv.NVML_ERROR_RESET_REQUIRED}
        for what, getter in _fields(nv, handle):
            try:
                values.update(getter())
            except nv.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code in lost_codes:
                    name = values.get("name", "unknown")
                    pci = values["pci_bus_id"]
                    errors[what] = str(exc)
                    return GpuReading(index=i, name=name, lost=True, pci_bus_id=pci, errors=errors)
                if code != nv.NVML_ERROR_NOT_SUPPORTED:
                    errors[what] = str(exc)
        if "name" not in values:  # not even the name: treat as unreadable
            return GpuReading(index=i, name="unknown", lost=True, errors=errors)
        return GpuReading(index=i, errors=errors, **values)

    def new_xids(self) -> list[tuple[int, int]]:
        """XIDs since the last call, from NVML events and the kernel log, de-duplicated."""
        seen: dict[tuple[int, int], None] = {}
        for pair in self._drain_events() + self._drain_kmsg():
            seen.setdefault(pair, None)
        return list(seen)

    def _drain_events(self) -> list[tuple[int, int]]:
        nv = self._nvml
        out: list[tuple[int, int]] = []
        if self._events is None:
            return out
        for _ in range(_MAX_EVENTS):
            try:
                data = nv.nvmlEventSetWait(self._events, 0)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) != nv.NVML_ERROR_TIMEOUT:
                    log.warning("NVML event wait failed: %s", exc)
                break
            if data.eventType & nv.nvmlEventTypeXidCriticalError:
                out.append((self._slot_of(data.device), int(data.eventData)))
        return out

    def _slot_of(self, device: Any) -> int:
        address = _address(device)
        for slot, handle in self._handles.items():
            if address is not None and _address(handle) == address:
                return slot
        return -1

    def _drain_kmsg(self) -> list[tuple[int, int]]:
        if self._kmsg_fd is None:
            return []
        lines: list[str] = []
        for _ in range(_MAX_EVENTS):
            try:
                chunk = os.read(self._kmsg_fd, 8192)
            except BrokenPipeError:  # records were overwritten before we read them
                continue
            except BlockingIOError:
                break
            if not chunk:
                break
            lines.extend(chunk.decode("utf-8", "replace").splitlines())
        by_pci = {pci_key(bus): slot for slot, bus in self._pci.items()}
        out: list[tuple[int, int]] = []
        for event in parse_kernel_xids(lines):
            slot = by_pci.get(pci_key(event.pci))
            if slot is not None:
                out.append((slot, event.xid))
        return out

    def close(self) -> None:
        """Release the event set, the kernel log and NVML. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._kmsg_fd is not None:
            os.close(self._kmsg_fd)
            self._kmsg_fd = None
        try:
            if self._events is not None:
                self._nvml.nvmlEventSetFree(self._events)
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.warning("NVML shutdown: %s", exc)

    def __enter__(self) -> NvmlSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fields(nv: Any, h: Any) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """(what, getter) pairs in reading order; each getter returns GpuReading fields."""

    def temperature() -> dict[str, Any]:
        try:
            celsius = nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
        except nv.NVMLError_FunctionNotFound:  # the deprecated call is gone: use its successor
            celsius = nv.nvmlDeviceGetTemperatureV(h, nv.NVML_TEMPERATURE_GPU)
        return {"temperature_c": float(celsius)}

    def throttle() -> dict[str, Any]:
        try:
            mask = nv.nvmlDeviceGetCurrentClocksEventReasons(h)
        except nv.NVMLError_FunctionNotFound:  # drivers older than the rename
            mask = nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)
        return {"throttle_reasons": decode_throttle(int(mask))}

    def ecc() -> dict[str, Any]:
        count = nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
        )
        return {"ecc_uncorrected_volatile": int(count)}

    def remap() -> dict[str, Any]:
        _corrected, _uncorrected, pending, failure = nv.nvmlDeviceGetRemappedRows(h)
        return {"remap_pending": bool(pending), "remap_failure": bool(failure)}

    def memory() -> dict[str, Any]:
        info = nv.nvmlDeviceGetMemoryInfo(h)
        return {"memory_used_mib": info.used / MIB, "memory_total_mib": info.total / MIB}

    return [
        ("name", lambda: {"name": _text(nv.nvmlDeviceGetName(h))}),
        ("temperature", temperature),
        ("power", lambda: {"power_w": nv.nvmlDeviceGetPowerUsage(h) / 1000.0}),
        ("throttle", throttle),
        ("ecc", ecc),
        ("remap", remap),
        (
            "retired_pages",
            lambda: {"retired_pages_pending": bool(nv.nvmlDeviceGetRetiredPagesPendingStatus(h))},
        ),
        (
            "utilization",
            lambda: {"utilization_pct": float(nv.nvmlDeviceGetUtilizationRates(h).gpu)},
        ),
        ("memory", memory),
    ]


def _import_pynvml() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise GpuUnavailable(
            "the pynvml module is missing: install it with `pip install nvidia-ml-py`"
        ) from exc


def _open_kmsg(path: Path | None) -> int | None:
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        log.info("kernel log %s not readable (%s); XIDs from NVML events only", path, exc)
        return None
    try:
        os.lseek(fd, 0, os.SEEK_END)
    except OSError:
        pass
    return fd


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _address(handle: Any) -> int | None:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)
