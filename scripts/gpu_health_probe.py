#!/usr/bin/env python3
"""Probe the GPU health checks on a machine with NVIDIA GPUs; print one JSON report.

Runs NvmlSource + GpuCheck on every GPU, the raw NVML calls behind them (so a surprise in
the driver's answers shows up as data, not as a crash), and the deep check on all GPUs.
Needs only the installed trainpod package (and its nvidia-ml-py dependency).

    python scripts/gpu_health_probe.py [--out probe.json] [--no-deep] [--deep-timeout-s 300]

Every step is guarded: a failure is recorded under its step's "error" and the probe goes
on. Exit status 0 when the probe ran to the end, whatever the GPUs' verdicts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def guarded(fn: Callable[[], Any]) -> Any:
    start = time.monotonic()
    try:
        value = fn()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
    if isinstance(value, dict) and "seconds" not in value:
        value["seconds"] = round(time.monotonic() - start, 4)
    return value


def jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "_fields_"):  # a ctypes structure from pynvml
        return {name: jsonable(getattr(value, name)) for name, *_ in value._fields_}
    return repr(value)


def device_calls(nv: Any, h: Any) -> dict[str, Callable[[], Any]]:
    """The raw NVML calls behind GpuReading, bound to one device handle."""
    return {
        "name": lambda: nv.nvmlDeviceGetName(h),
        "pci": lambda: nv.nvmlDeviceGetPciInfo(h),
        "index": lambda: nv.nvmlDeviceGetIndex(h),
        "temperature": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
        "temperatureV": lambda: nv.nvmlDeviceGetTemperatureV(h, nv.NVML_TEMPERATURE_GPU),
        "power_mw": lambda: nv.nvmlDeviceGetPowerUsage(h),
        "clocks_event_reasons": lambda: hex(nv.nvmlDeviceGetCurrentClocksEventReasons(h)),
        "clocks_throttle_reasons": lambda: hex(nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
        "ecc_uncorrected_volatile": lambda: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
        ),
        "ecc_uncorrected_aggregate": lambda: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC
        ),
        "remapped_rows": lambda: nv.nvmlDeviceGetRemappedRows(h),
        "retired_pages_pending": lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h),
        "utilization": lambda: nv.nvmlDeviceGetUtilizationRates(h),
        "memory": lambda: nv.nvmlDeviceGetMemoryInfo(h),
        "supported_events": lambda: hex(nv.nvmlDeviceGetSupportedEventTypes(h)),
        "xid_event_supported": lambda: bool(
            nv.nvmlDeviceGetSupportedEventTypes(h) & nv.nvmlEventTypeXidCriticalError
        ),
    }


def raw_nvml() -> dict[str, Any]:
    """Every NVML call the health checks make, answered raw, per GPU."""
    import pynvml as nv  # type: ignore[import-untyped]  # nvidia-ml-py ships no type hints

    nv.nvmlInit()
    try:
        out: dict[str, Any] = {
            "driver": guarded(lambda: jsonable(nv.nvmlSystemGetDriverVersion())),
            "nvml": guarded(lambda: jsonable(nv.nvmlSystemGetNVMLVersion())),
            "count": guarded(nv.nvmlDeviceGetCount),
            "gpus": [],
        }
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            calls = device_calls(nv, h)
            gpu: dict[str, Any] = {}
            for key, call in calls.items():
                start = time.monotonic()
                try:
                    gpu[key] = jsonable(call())
                except Exception as exc:
                    gpu[key] = {"error": f"{type(exc).__name__}: {exc}"}
                gpu[f"{key}_ms"] = round((time.monotonic() - start) * 1000, 3)
            out["gpus"].append(gpu)
        return out
    finally:
        nv.nvmlShutdown()


def health_check(expected: int) -> dict[str, Any]:
    """NvmlSource + GpuCheck as the agent uses them, run three times (cost, stickiness)."""
    from trainpod.agent.health import GpuCheck, NvmlSource

    with NvmlSource() as source:
        out: dict[str, Any] = {
            "event_registration_errors": source.event_errors,
            "kmsg_readable": source.kmsg_readable,
        }
        check = GpuCheck(source, expected_count=expected)
        runs = []
        for _ in range(3):
            start = time.monotonic()
            result = check.run()
            runs.append({"ms": round((time.monotonic() - start) * 1000, 3), **result.to_dict()})
        out["runs"] = runs
        out["new_xids_after"] = source.new_xids()
        return out


def deep(devices: int, timeout_s: float) -> dict[str, Any]:
    from trainpod.agent.health import run_deep_check

    with tempfile.TemporaryDirectory(prefix="trainpod-probe-") as scratch:
        start = time.monotonic()
        result = run_deep_check(devices, Path(scratch), None, timeout_s=timeout_s, kind="cuda")
        return {"wall_s": round(time.monotonic() - start, 3), **result.to_dict()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="also write the report here")
    p.add_argument("--no-deep", action="store_true", help="skip the deep check")
    p.add_argument("--deep-timeout-s", type=float, default=300.0)
    args = p.parse_args()
    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    report["raw_nvml"] = guarded(raw_nvml)
    count = report["raw_nvml"].get("count")
    count = count if isinstance(count, int) else 0
    report["gpu_check"] = guarded(lambda: health_check(count))
    if not args.no_deep and count:
        report["deep"] = guarded(lambda: deep(count, args.deep_timeout_s))
    text = json.dumps(jsonable(report), indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
