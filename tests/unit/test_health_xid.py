"""XID classification and kernel-log parsing."""

from __future__ import annotations

import pytest

from trainpod.agent.health import Status, XidKind, classify_xid, parse_kernel_xids, xid_status
from trainpod.agent.health.xid import XID_TABLE, XidEvent, describe_xid, pci_key


@pytest.mark.parametrize("xid", [48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140])
def test_node_fault_xids_are_faults(xid: int) -> None:
    assert classify_xid(xid).kind is XidKind.NODE
    assert xid_status(xid) is Status.FAULT


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68])
def test_application_xids_are_the_jobs_problem(xid: int) -> None:
    assert classify_xid(xid).kind is XidKind.JOB
    assert xid_status(xid) is Status.WARN
    assert "application" in describe_xid(xid)
    assert "not the node's" in describe_xid(xid)


def test_unknown_xid_is_a_warning() -> None:
    assert classify_xid(99999).kind is XidKind.UNKNOWN
    assert xid_status(99999) is Status.WARN
    assert "unknown" in describe_xid(99999)


def test_every_row_has_a_one_line_meaning() -> None:
    for xid, info in XID_TABLE.items():
        assert info.xid == xid
        assert info.meaning and "\n" not in info.meaning


def test_parse_kernel_xids_from_dmesg_and_kmsg_lines() -> None:
    lines = [
        "[ 1234.5678] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
        "4,1043,98765432,-;NVRM: Xid (PCI:0000:65:00): 119, pid='N/A', Timeout waiting for RPC",
        " SUBSYSTEM=pci",
        "unrelated kernel line",
        "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping",
        "NVRM: Xid (PCI:0000:3b:00): 13",
    ]
    assert parse_kernel_xids(lines) == [
        XidEvent("0000:3b:00", 79, "pid=1234, GPU has fallen off the bus."),
        XidEvent("0000:65:00", 119, "pid='N/A', Timeout waiting for RPC"),
        XidEvent("0000:10:1c", 63, "pid=1896, Row Remapper: New row marked for remapping"),
        XidEvent("0000:3b:00", 13, ""),
    ]


def test_pci_key_matches_kernel_and_nvml_spellings() -> None:
    assert pci_key("PCI:0000:3b:00") == pci_key("00000000:3B:00.0") == (0, 0x3B, 0)
    assert pci_key("garbage") is None
    assert pci_key("zz:yy:xx") is None
