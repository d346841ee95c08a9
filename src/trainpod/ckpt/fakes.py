"""Fake file systems for fault-injection tests of checkpoint tiers (they ship for users' tests).

* :class:`FlakyFileSystem` (``flaky://``): local files behind a switch; while ``down`` every
  operation raises ``ConnectionError``, like an object store that is unreachable for a while.
* :class:`FullFileSystem`: local files on a disk that holds ``capacity`` bytes; writes past
  it raise ``OSError(ENOSPC)``, like a full scratch disk.

Both are fsspec file systems; pass them to :class:`trainpod.ckpt.FsTier`. Thread-safe as far
as the local file system is.
"""

from __future__ import annotations

import errno
import threading
from typing import Any

import fsspec  # type: ignore[import-untyped]  # no type hints
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]


class FlakyFileSystem(LocalFileSystem):  # type: ignore[misc]  # fsspec is untyped
    """``flaky:///abs/path``: local files; ``down = True`` makes every call fail."""

    protocol = ("flaky",)
    cachable = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.down = False
        self.refused = 0
        self._lock = threading.Lock()

    def _check(self) -> None:
        if self.down:
            with self._lock:
                self.refused += 1
            raise ConnectionError("flaky: the store is unreachable")

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        self._check()
        return super()._open(path, mode, *args, **kwargs)

    def ls(self, path: str, detail: bool = False, **kwargs: Any) -> Any:
        self._check()
        return super().ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        self._check()
        return super().info(path, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._check()
        super().makedirs(path, exist_ok=exist_ok)

    def rm(self, path: str, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._check()
        super().rm(path, recursive=recursive, maxdepth=maxdepth)


class _CappedFile:
    def __init__(self, fs: FullFileSystem, f: Any) -> None:
        self._fs, self._f = fs, f

    def write(self, data: bytes) -> int:
        self._fs.reserve(len(data))
        n: int = self._f.write(data)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _CappedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


class FullFileSystem(LocalFileSystem):  # type: ignore[misc]  # fsspec is untyped
    """Local files, but only ``capacity`` bytes may be written in total (then ENOSPC)."""

    cachable = False

    def __init__(self, capacity: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.capacity = capacity
        self.used = 0
        self._lock = threading.Lock()

    def reserve(self, n: int) -> None:
        with self._lock:
            if self.used + n > self.capacity:
                raise OSError(errno.ENOSPC, "No space left on device (FullFileSystem)")
            self.used += n

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        f = super()._open(path, mode, *args, **kwargs)
        return _CappedFile(self, f) if any(c in mode for c in "wa") else f


fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
