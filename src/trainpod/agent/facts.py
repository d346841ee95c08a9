"""Facts an agent reports about its node: devices, CPU, memory, disk.

On a machine without GPUs a node's devices are CPU slots standing in for GPUs; every
report marks them ``simulated`` so nothing downstream mistakes them for real GPUs.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil


def detect_gpus() -> list[str]:
    """Indices of the NVIDIA GPUs on this machine (via nvidia-smi), or [] when there are none."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def device_facts(devices: int, gpu_slice: list[str]) -> dict[str, Any]:
    if gpu_slice:
        return {"kind": "cuda", "count": len(gpu_slice), "visible": gpu_slice, "simulated": False}
    return {"kind": "cpu", "count": devices, "visible": [], "simulated": devices > 0}


def node_facts(scratch: Path, devices: dict[str, Any]) -> dict[str, Any]:
    mem = psutil.virtual_memory()
    try:
        disk = shutil.disk_usage(scratch)
        free_gib = round(disk.free / 2**30, 2)
    except OSError:
        free_gib = None
    return {
        "hostname": socket.gethostname(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "load1": round(os.getloadavg()[0], 2),
        "mem_total_gib": round(mem.total / 2**30, 2),
        "mem_available_gib": round(mem.available / 2**30, 2),
        "scratch_free_gib": free_gib,
        "devices": devices,
    }
