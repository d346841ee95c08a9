"""NVIDIA XID classification and kernel-log parsing.

An XID is an error report from the NVIDIA driver. Some mean the GPU or node is broken
(``NODE``: quarantine it), some mean the running program did something wrong (``JOB``: the
job's problem, the node stays in service), and the rest are ``UNKNOWN`` (report, keep the
node). The table follows NVIDIA's XID catalog for Ampere and newer GPUs; the meanings are
one-line summaries, not the catalog's text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from trainpod.agent.health.base import Status


class XidKind(str, Enum):
    """Whose problem an XID is."""

    NODE = "node"
    JOB = "job"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class XidInfo:
    """One row of the table: the XID, whose problem it is and what it means."""

    xid: int
    kind: XidKind
    meaning: str


def _table(rows: Iterable[tuple[int, XidKind, str]]) -> Mapping[int, XidInfo]:
    return MappingProxyType({xid: XidInfo(xid, kind, meaning) for xid, kind, meaning in rows})


_N, _J = XidKind.NODE, XidKind.JOB

XID_TABLE: Mapping[int, XidInfo] = _table(
    [
        (13, _J, "graphics engine exception (usually a bad kernel or out-of-range access)"),
        (31, _J, "GPU memory page fault (MMU fault: illegal address in the program)"),
        (43, _J, "GPU stopped processing (the program's channel was aborted)"),
        (45, _J, "preemptive cleanup (channel torn down after the program was killed)"),
        (48, _N, "double-bit ECC error (uncorrectable memory error)"),
        (61, _N, "internal micro-controller breakpoint/warning"),
        (62, _N, "internal micro-controller halt"),
        (63, _N, "ECC page retirement or row remapping event (reset needed to apply)"),
        (64, _N, "ECC page retirement or row remapping failure"),
        (68, _J, "video processor (NVDEC) exception"),
        (74, _N, "NVLink error"),
        (79, _N, "GPU has fallen off the bus"),
        (92, _N, "high single-bit ECC error rate"),
        (94, _N, "contained ECC error (the affected program was stopped)"),
        (95, _N, "uncontained ECC error (all programs on the GPU affected)"),
        (119, _N, "GSP RPC timeout (GPU System Processor not responding)"),
        (120, _N, "GSP error (GPU System Processor firmware error)"),
        (140, _N, "unrecovered ECC error"),
        (154, _N, "GPU recovery action changed (GPU reset or node reboot required)"),
    ]
)

NODE_FAULT_XIDS: frozenset[int] = frozenset(x for x, i in XID_TABLE.items() if i.kind is _N)
APPLICATION_XIDS: frozenset[int] = frozenset(x for x, i in XID_TABLE.items() if i.kind is _J)


def classify_xid(xid: int) -> XidInfo:
    """The table row for ``xid``; an XID not in the table is ``UNKNOWN``."""
    return XID_TABLE.get(xid) or XidInfo(xid, XidKind.UNKNOWN, "not in trainpod's XID table")


def xid_status(xid: int) -> Status:
    """FAULT for a node-fault XID, WARN for an application or unknown one."""
    return Status.FAULT if classify_xid(xid).kind is XidKind.NODE else Status.WARN


def describe_xid(xid: int) -> str:
    """A one-line human description, e.g. ``"XID 79 (GPU has fallen off the bus)"``.

    Application XIDs say that they are the job's problem, not the node's.
    """
    info = classify_xid(xid)
    if info.kind is XidKind.JOB:
        return f"XID {xid} ({info.meaning}): application error, the job's problem, not the node's"
    if info.kind is XidKind.UNKNOWN:
        return f"XID {xid} (unknown XID, not classified)"
    return f"XID {xid} ({info.meaning})"


@dataclass(frozen=True)
class XidEvent:
    """One XID line from the kernel log. ``pci`` is as logged, e.g. ``"0000:3b:00"``."""

    pci: str
    xid: int
    message: str


# "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
_XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+)(?:, ?(.*))?")


def parse_kernel_xids(lines: Iterable[str]) -> list[XidEvent]:
    """Every XID event in ``lines`` (dmesg, /dev/kmsg records or journal lines), in order.

    A line may carry any prefix (timestamp, kmsg header); lines without an XID are skipped.
    Pure: no I/O.
    """
    events: list[XidEvent] = []
    for line in lines:
        match = _XID_RE.search(line)
        if match is None:
            continue
        pci, xid, message = match.groups()
        events.append(XidEvent(pci=pci, xid=int(xid), message=(message or "").strip()))
    return events


def pci_key(bus_id: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of a PCI bus id in any common spelling, or None if unparsable.

    Matches the kernel's ``"PCI:0000:3b:00"`` with NVML's ``"00000000:3B:00.0"``.
    """
    text = bus_id.strip()
    if text.upper().startswith("PCI:"):
        text = text[4:]
    text = text.split(".", 1)[0]
    parts = text.split(":")
    if len(parts) != 3:
        return None
    try:
        domain, bus, device = (int(p, 16) for p in parts)
    except ValueError:
        return None
    return (domain, bus, device)
