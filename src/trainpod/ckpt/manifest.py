"""The manifest: what makes a checkpoint count, and how it is written atomically.

A checkpoint directory holds PyTorch DCP files (``__<rank>_<n>.distcp`` and ``.metadata``)
and, once committed, ``manifest.json``: the step, the world size and nodes, and for every
file its size, SHA-256 and the rank/node that wrote it. The manifest is written last, with
tmp + fsync + rename (local) or one whole-object put (object stores), so a directory
without a manifest is torn or in progress and is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from trainpod.ckpt.errors import ManifestError

FORMAT = "trainpod-ckpt/1"
MANIFEST = "manifest.json"
METADATA = ".metadata"
"""DCP's global metadata file name (``torch.distributed.checkpoint.filesystem._metadata_fn``)."""
CHUNK = 8 << 20


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint. ``rank`` is None for ``.metadata`` (every node keeps a copy)."""

    name: str
    size: int
    sha256: str
    rank: int | None
    node: str


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint (identical in every tier that holds it)."""

    step: int
    world_size: int
    nodes: tuple[str, ...]
    files: tuple[FileEntry, ...]
    job: str = ""
    attempt: int = 1
    created: float = field(default_factory=time.time)

    def entry(self, name: str) -> FileEntry | None:
        for f in self.files:
            if f.name == name:
                return f
        return None

    def files_of(self, node: str) -> list[FileEntry]:
        """The files a node-local tier on ``node`` holds: its ranks' files and ``.metadata``."""
        return [f for f in self.files if f.node == node or f.rank is None]

    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "format": FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "nodes": list(self.nodes),
            "job": self.job,
            "attempt": self.attempt,
            "created": self.created,
            "files": [
                {"name": f.name, "size": f.size, "sha256": f.sha256, "rank": f.rank, "node": f.node}
                for f in self.files
            ],
        }
        return json.dumps(body, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse a manifest. Raises :class:`ManifestError` on anything malformed."""
        try:
            body = json.loads(data)
            if body.get("format") != FORMAT:
                raise ManifestError(f"unknown manifest format {body.get('format')!r}")
            files = tuple(
                FileEntry(
                    name=str(f["name"]),
                    size=int(f["size"]),
                    sha256=str(f["sha256"]),
                    rank=None if f["rank"] is None else int(f["rank"]),
                    node=str(f["node"]),
                )
                for f in body["files"]
            )
            m = cls(
                step=int(body["step"]),
                world_size=int(body["world_size"]),
                nodes=tuple(str(n) for n in body["nodes"]),
                files=files,
                job=str(body.get("job", "")),
                attempt=int(body.get("attempt", 1)),
                created=float(body.get("created", 0.0)),
            )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise ManifestError(f"malformed manifest: {exc!r}") from exc
        if m.entry(METADATA) is None:
            raise ManifestError("manifest lists no .metadata")
        return m


def hash_stream(stream: IO[bytes]) -> tuple[int, str]:
    """(size, sha256 hex) of a readable binary stream, read in 8 MiB chunks (GIL released)."""
    h = hashlib.sha256()
    size = 0
    while chunk := stream.read(CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def hash_file(path: Path) -> tuple[int, str]:
    with path.open("rb") as f:
        return hash_stream(f)


def entries(
    directory: Path, names: Iterable[str], *, rank: int | None, node: str
) -> list[FileEntry]:
    """Hash the named files of ``directory`` into entries. Raises OSError if one is missing."""
    out = []
    for name in sorted(names):
        size, digest = hash_file(directory / name)
        out.append(FileEntry(name, size, digest, rank, node))
    return out


def rank_files(directory: Path, rank: int) -> list[str]:
    """The DCP data files rank ``rank`` wrote into ``directory`` (``__<rank>_<n>.distcp``)."""
    prefix = f"__{rank}_"
    return sorted(
        p.name for p in directory.iterdir() if p.name.startswith(prefix) and p.suffix == ".distcp"
    )


def write_atomic(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part.

    tmp file in the same dir, fsync, rename over, fsync the dir (skipped with ``sync=False``,
    for tmpfs). Several writers of the same bytes may race (each renames a file of its own).
    Raises OSError.
    """
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
