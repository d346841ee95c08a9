"""A simulated GPU whose faults are injected by writing a JSON state file.

On machines without GPUs a node's devices are CPU slots; this source reports them as GPUs
that are healthy until the chaos tool (or a test) injects a fault with :func:`inject`.
:func:`clear` puts the GPUs back in order, like replacing the hardware.

State file schema (every key optional; a missing file means "all healthy")::

    {
      "epoch": "5f0c...",                 # changes on every clear(): XIDs are counted afresh
      "xids": [{"gpu": 0, "xid": 79}],    # XID events in order; kept until clear()
      "ecc_uncorrected": {"0": 2},        # volatile uncorrectable ECC errors per GPU
      "thermal": {"1": true},             # GPU is thermally throttled (sw+hw thermal)
      "temperature_c": {"0": 92},         # GPU temperature (default 40 C)
      "lost": [1],                        # GPUs that fell off the bus (not enumerated)
      "remap_failure": [0],               # GPUs whose row remapping failed
      "remap_pending": [0],               # GPUs with a row remap pending (needs a reset)
      "slow": {"0": 2.0}                  # step-time factor for simulated stragglers;
                                          # not read by the health checks
    }

GPU keys of the dicts are decimal strings (JSON has no integer keys). Unknown keys are
errors. Writers replace the file atomically, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from trainpod.agent.health.readings import GpuReading
from trainpod.agent.health.xid import NODE_FAULT_XIDS, classify_xid
from trainpod.errors import Fatal

KEYS = frozenset(
    {"epoch", "xids", "ecc_uncorrected", "thermal", "temperature_c", "lost"}
    | {"remap_failure", "remap_pending", "slow"}
)
FAULTS = ("xid79", "xid48", "xid13", "ecc", "thermal", "remap", "lost")
DEFAULT_TEMPERATURE_C = 40.0
HOT_C = 92.0


class SimulatedStateError(Fatal):
    """The simulated GPU state file or an injected fault name is invalid."""


def load_state(state_file: Path) -> dict[str, Any]:
    """The state in ``state_file``; ``{}`` when it does not exist. Raises on bad content."""
    try:
        text = state_file.read_text()
    except FileNotFoundError:
        return {}
    try:
        state = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise SimulatedStateError(f"{state_file}: not JSON ({exc}); fix or clear it") from exc
    if not isinstance(state, dict):
        raise SimulatedStateError(f"{state_file}: expected a JSON object, got {state!r}")
    unknown = sorted(set(state) - KEYS)
    if unknown:
        raise SimulatedStateError(
            f"{state_file}: unknown keys {unknown}; known keys are {sorted(KEYS)}"
        )
    return state


def _save(state_file: Path, state: dict[str, Any]) -> None:
    state_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = state_file.with_name(f".{state_file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    os.replace(tmp, state_file)


def inject(state_file: Path, fault: str, gpu: int = 0) -> None:
    """Inject ``fault`` on simulated GPU ``gpu`` by rewriting ``state_file`` atomically.

    Faults: ``xid79``, ``xid48``, ``xid13`` (or any ``xid<N>``), ``ecc`` (one more
    uncorrectable error), ``thermal`` (throttled at 92 C), ``remap`` (row-remap failure),
    ``lost`` (fallen off the bus). Idempotent except for XIDs and ``ecc``, which add events.
    """
    state = load_state(state_file)
    state.setdefault("epoch", uuid.uuid4().hex)
    key = str(gpu)
    match = re.fullmatch(r"xid(\d+)", fault)
    if match:
        state.setdefault("xids", []).append({"gpu": gpu, "xid": int(match.group(1))})
    elif fault == "ecc":
        ecc = state.setdefault("ecc_uncorrected", {})
        ecc[key] = int(ecc.get(key, 0)) + 1
    elif fault == "thermal":
        state.setdefault("thermal", {})[key] = True
        state.setdefault("temperature_c", {})[key] = HOT_C
    elif fault in ("remap", "lost"):
        name = "remap_failure" if fault == "remap" else "lost"
        gpus = state.setdefault(name, [])
        if gpu not in gpus:
            gpus.append(gpu)
    else:
        raise SimulatedStateError(f"unknown fault {fault!r}; use one of {', '.join(FAULTS)}")
    _save(state_file, state)


def clear(state_file: Path) -> None:
    """Make every simulated GPU healthy again (a new epoch: XIDs are counted afresh)."""
    _save(state_file, {"epoch": uuid.uuid4().hex})


def simulated_faults(state_file: Path) -> dict[int, str]:
    """GPU index -> why it is broken, for every simulated GPU with an active node fault.

    Active: lost, a node-fault XID not yet cleared, uncorrectable ECC, or a remap failure.
    Thermal throttling and application XIDs are not faults. Used by the deep check.
    """
    state = load_state(state_file)
    why: dict[int, list[str]] = {}
    for gpu in state.get("lost", []):
        why.setdefault(int(gpu), []).append("lost (fallen off the bus)")
    for event in state.get("xids", []):
        xid = int(event["xid"])
        if xid in NODE_FAULT_XIDS:
            meaning = classify_xid(xid).meaning
            why.setdefault(int(event["gpu"]), []).append(f"XID {xid} ({meaning}) not cleared")
    for key, count in state.get("ecc_uncorrected", {}).items():
        if int(count) > 0:
            why.setdefault(int(key), []).append(f"{int(count)} uncorrectable ECC errors")
    for gpu in state.get("remap_failure", []):
        why.setdefault(int(gpu), []).append("row remapping failed")
    return {gpu: "; ".join(reasons) for gpu, reasons in sorted(why.items())}


class SimulatedSource:
    """``count`` simulated GPUs whose state is read from ``state_file`` on every call.

    XIDs are returned once each by :meth:`new_xids` (the count consumed is kept in memory
    and restarts when :func:`clear` starts a new epoch). Raises :class:`SimulatedStateError`
    on a malformed state file.
    """

    kind = "simulated"
    simulated = True

    def __init__(self, state_file: Path, count: int) -> None:
        self.state_file = state_file
        self._count = count
        self._epoch: str | None = None
        self._consumed = 0

    def count(self) -> int:
        """GPUs that are enumerated: all but the lost ones."""
        lost = {int(g) for g in load_state(self.state_file).get("lost", [])}
        return sum(1 for i in range(self._count) if i not in lost)

    def read(self, i: int) -> GpuReading:
        state = load_state(self.state_file)
        key = str(i)
        lost = {int(g) for g in state.get("lost", [])}
        name = "simulated GPU (CPU slot)"
        if i >= self._count or i in lost:
            return GpuReading(index=i, name=name, lost=True)
        thermal = bool(state.get("thermal", {}).get(key, False))
        return GpuReading(
            index=i,
            name=name,
            temperature_c=float(state.get("temperature_c", {}).get(key, DEFAULT_TEMPERATURE_C)),
            power_w=100.0,
            throttle_reasons=["sw_thermal", "hw_thermal"] if thermal else [],
            ecc_uncorrected_volatile=int(state.get("ecc_uncorrected", {}).get(key, 0)),
            remap_pending=i in {int(g) for g in state.get("remap_pending", [])},
            remap_failure=i in {int(g) for g in state.get("remap_failure", [])},
            retired_pages_pending=False,
            utilization_pct=0.0,
            memory_used_mib=0.0,
            memory_total_mib=81920.0,
            pci_bus_id=f"00000000:{i + 1:02X}:00.0",
        )

    def new_xids(self) -> list[tuple[int, int]]:
        """XIDs injected since the last call (or since the last clear)."""
        state = load_state(self.state_file)
        epoch = state.get("epoch")
        if epoch != self._epoch:
            self._epoch, self._consumed = epoch, 0
        xids = state.get("xids", [])
        new = xids[self._consumed :]
        self._consumed = len(xids)
        return [(int(e["gpu"]), int(e["xid"])) for e in new]
