"""The disk check with real files: quotas filled by a real ballast, broken paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainpod.agent.health import DiskCheck, Status, fill, unfill
from trainpod.agent.health.disk import BALLAST, GIB, used_bytes, write_test


def test_healthy_dir_is_ok_and_leaves_nothing_behind(tmp_path: Path) -> None:
    result = DiskCheck({"scratch": tmp_path}, min_free_gib=0.001).run()
    assert result.status is Status.OK, result.reason
    assert result.facts["scratch"]["write_ok"] is True
    assert result.facts["scratch"]["free_gib"] > 0
    assert list(tmp_path.iterdir()) == []


def test_fill_over_quota_is_disk_full_and_unfill_recovers(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_bytes(b"x" * 1000)
    check = DiskCheck({"scratch": tmp_path}, min_free_gib=0.001, quota_gib={"scratch": 0.01})
    assert check.run().status is Status.OK

    ballast = fill(tmp_path, 0.01)
    assert ballast == tmp_path / BALLAST
    used, complete = used_bytes(tmp_path)
    assert complete
    assert 0.01 * GIB < used <= 0.01 * GIB + 2 * 2**20  # ~1 MiB over, not more
    result = check.run()
    assert result.status is Status.FAULT
    assert result.reason.startswith(f"disk full: {tmp_path} uses ")
    assert "of its 0.01 GiB quota" in result.reason

    unfill(tmp_path)
    unfill(tmp_path)  # idempotent
    assert check.run().status is Status.OK


def test_missing_dir_is_a_fault(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    result = DiskCheck({"scratch": missing}, min_free_gib=0.001).run()
    assert result.status is Status.FAULT
    assert "ENOENT" in result.reason


def test_a_file_instead_of_a_dir_fails_the_write_test(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("not a dir")
    assert write_test(afile) is not None
    result = DiskCheck({"scratch": afile}, min_free_gib=0.001).run()
    assert result.status is Status.FAULT
    assert "write test failed" in result.reason
    assert "ENOTDIR" in result.reason


def test_too_little_free_space_is_a_fault(tmp_path: Path) -> None:
    result = DiskCheck({"scratch": tmp_path}, min_free_gib=1e9).run()
    assert result.status is Status.FAULT
    assert result.reason.startswith(f"disk full: {tmp_path} has ")


def test_quota_for_an_unknown_path_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quota for unknown paths"):
        DiskCheck({"scratch": tmp_path}, quota_gib={"ckpt": 1.0})
