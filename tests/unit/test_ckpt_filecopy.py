"""Copying a checkpoint file with O_DIRECT where the file system takes it (ADR 0054)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from trainpod.ckpt import filecopy
from trainpod.ckpt.filecopy import BLOCK, copy_file


def _direct_works(d: Path) -> bool:
    try:
        fd = os.open(d / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    return True


def _source(d: Path, size: int) -> Path:
    src = d / "src.bin"
    src.write_bytes(os.urandom(size))
    return src


@pytest.fixture(autouse=True)
def _small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(filecopy, "PIECE", 2 * BLOCK)  # several writes per file


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 7 * BLOCK + 123, 8 * BLOCK])
@pytest.mark.parametrize("direct", [True, False])
def test_a_copy_has_the_source_s_bytes_whatever_its_size(
    tmp_path: Path, size: int, direct: bool
) -> None:
    src = _source(tmp_path, size)
    dst = tmp_path / "dst.bin"
    dst.write_bytes(b"x" * (size + 3 * BLOCK))  # an older, longer file is replaced
    seen: list[int] = []
    how = copy_file(src, dst, size, seen.append, sync=True, direct=direct)
    assert dst.read_bytes() == src.read_bytes()
    assert sum(seen) == size
    aligned = direct and size >= BLOCK and _direct_works(tmp_path)
    assert how == ("direct" if aligned else "sendfile")


def test_a_file_system_that_refuses_o_direct_at_open_gets_sendfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refuse(path: object, flags: int, *a: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refuse)
    src = _source(tmp_path, 5 * BLOCK + 7)
    dst = tmp_path / "dst.bin"
    assert copy_file(src, dst, 5 * BLOCK + 7, lambda n: None, sync=True) == "sendfile"
    assert dst.read_bytes() == src.read_bytes()


def test_one_that_takes_the_flag_but_refuses_the_write_gets_sendfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _direct_works(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT at open already")

    def refuse(fd: int, data: object) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "write", refuse)
    src = _source(tmp_path, 3 * BLOCK)
    dst = tmp_path / "dst.bin"
    assert copy_file(src, dst, 3 * BLOCK, lambda n: None, sync=False) == "sendfile"
    assert dst.read_bytes() == src.read_bytes()


@pytest.mark.parametrize("direct", [True, False])
def test_a_source_shorter_than_said_is_an_os_error(tmp_path: Path, direct: bool) -> None:
    src = _source(tmp_path, 2 * BLOCK)
    with pytest.raises(OSError, match="shrank"):
        copy_file(src, tmp_path / "dst.bin", 4 * BLOCK, lambda n: None, sync=False, direct=direct)
