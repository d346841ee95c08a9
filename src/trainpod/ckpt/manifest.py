"""The manifest: what makes a checkpoint count, and how it is written atomically.

A checkpoint directory holds PyTorch DCP files (``__<rank>_<n>.distcp`` and ``.metadata``)
and, once committed, ``manifest.json``: the step, the world size and nodes, and for every
file its size, checksum and the rank/node that wrote it. The manifest is written last, with
tmp + fsync + rename (local) or one whole-object put (object stores), so a directory
without a manifest is torn or in progress and is never loaded.

The checksum is CRC-32C (:data:`HASH`, in C with the CPU's CRC instruction: ~3.6 GiB/s
here against SHA-256's ~1.1, reading from shared memory; it guards against torn, truncated
and corrupted files, which is what it is for: whoever can write a checkpoint can write its
manifest too, so a cryptographic hash would buy nothing). Manifests of format
``trainpod-ckpt/1`` (SHA-256) are still read and verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import google_crc32c

from trainpod.ckpt.errors import ManifestError

FORMAT = "trainpod-ckpt/2"
FORMAT_SHA256 = "trainpod-ckpt/1"
"""The first format: every file's SHA-256 (read, never written)."""
HASH = "crc32c"
MANIFEST = "manifest.json"
METADATA = ".metadata"
"""DCP's global metadata file name (``torch.distributed.checkpoint.filesystem._metadata_fn``)."""
CHUNK = 8 << 20


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint. ``rank`` is None for ``.metadata`` (every node keeps a copy)."""

    name: str
    size: int
    digest: str
    """The file's checksum in hex, by :attr:`algo`."""
    rank: int | None
    node: str
    algo: str = HASH


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
        # In the format its checksums are of: a checkpoint of format 1 copied to another
        # tier keeps its bytes (every node's copy of a manifest must be the same).
        algos = {f.algo for f in self.files} or {HASH}
        if algos == {HASH}:
            head: dict[str, Any] = {"format": FORMAT, "hash": HASH}
            key = "digest"
        elif algos == {"sha256"}:
            head, key = {"format": FORMAT_SHA256}, "sha256"
        else:
            raise ManifestError(f"a manifest's files have one checksum, not {sorted(algos)}")
        body: dict[str, Any] = {
            **head,
            "step": self.step,
            "world_size": self.world_size,
            "nodes": list(self.nodes),
            "job": self.job,
            "attempt": self.attempt,
            "created": self.created,
            "files": [
                {"name": f.name, "size": f.size, key: f.digest, "rank": f.rank, "node": f.node}
                for f in self.files
            ],
        }
        return json.dumps(body, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse a manifest. Raises :class:`ManifestError` on anything malformed."""
        try:
            body = json.loads(data)
            fmt = body.get("format")
            if fmt == FORMAT:
                algo, key = str(body["hash"]), "digest"
                if algo != HASH:
                    raise ManifestError(f"unknown checksum {algo!r} (this version knows {HASH})")
            elif fmt == FORMAT_SHA256:
                algo, key = "sha256", "sha256"
            else:
                raise ManifestError(f"unknown manifest format {fmt!r}")
            files = tuple(
                FileEntry(
                    name=str(f["name"]),
                    size=int(f["size"]),
                    digest=str(f[key]),
                    rank=None if f["rank"] is None else int(f["rank"]),
                    node=str(f["node"]),
                    algo=algo,
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


def hash_stream(stream: IO[bytes], algo: str = HASH) -> tuple[int, str]:
    """(size, checksum hex by ``algo``) of a readable binary stream, read in 8 MiB chunks."""
    size = 0
    if algo == HASH:
        crc = 0
        while chunk := stream.read(CHUNK):
            crc = google_crc32c.extend(crc, chunk)
            size += len(chunk)
        return size, f"{crc:08x}"
    if algo != "sha256":
        raise ManifestError(f"unknown checksum {algo!r}")
    h = hashlib.sha256()
    while chunk := stream.read(CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def digest_of(data: bytes) -> str:
    """The checksum (:data:`HASH`) of ``data``, in hex."""
    return f"{google_crc32c.value(data):08x}"


def hash_file(path: Path) -> tuple[int, str]:
    with path.open("rb") as f:
        return hash_stream(f)


def entries(
    directory: Path,
    names: Iterable[str],
    *,
    rank: int | None,
    node: str,
    known: Mapping[str, tuple[int, str]] | None = None,
) -> list[FileEntry]:
    """Hash the named files of ``directory`` into entries. Raises OSError if one is missing.

    ``known``: (size, checksum) of files computed as they were written; such a file is not
    read back, only its size checked (a mismatch: it is read back)."""
    out = []
    for name in sorted(names):
        path = directory / name
        got = (known or {}).get(name)
        if got is not None and path.stat().st_size == got[0]:
            size, digest = got
        else:
            size, digest = hash_file(path)
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
