"""The manifest's checksums: CRC-32C in format 2, SHA-256 in format 1 (still read and
verified: checkpoints written before the change load as before)."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import torch
from tests.unit.test_ckpt_faults import clean_env, flip_byte, load, make_state, saved, step_dirs

from trainpod.ckpt.errors import ManifestError
from trainpod.ckpt.manifest import (
    FORMAT,
    FORMAT_SHA256,
    HASH,
    MANIFEST,
    METADATA,
    FileEntry,
    Manifest,
    digest_of,
    hash_stream,
)

__all__ = ["clean_env", "saved"]  # the fixtures, shared with the faults' tests


def manifest(*files: FileEntry) -> Manifest:
    return Manifest(3, 2, ("n0", "n1"), files, "job", 1, 1700000000.0)


def test_crc32c_is_the_standard_one_and_the_stream_agrees_with_the_bytes() -> None:
    assert digest_of(b"123456789") == "e3069283"  # CRC-32C's check value
    data = bytes(range(256)) * 70_000  # 17.9 MB: several read chunks
    assert hash_stream(io.BytesIO(data)) == (len(data), digest_of(data))
    assert hash_stream(io.BytesIO(data), "sha256") == (len(data), hashlib.sha256(data).hexdigest())
    with pytest.raises(ManifestError, match="unknown checksum 'md5'"):
        hash_stream(io.BytesIO(data), "md5")


def test_format_2_round_trips_with_its_checksum_named() -> None:
    m = manifest(
        FileEntry("__0_0.distcp", 10, digest_of(b"a"), 0, "n0"),
        FileEntry(METADATA, 3, digest_of(b"m"), None, "n0"),
    )
    body = json.loads(m.to_json())
    assert (body["format"], body["hash"]) == (FORMAT, HASH)
    assert set(body["files"][0]) == {"name", "size", "digest", "rank", "node"}
    assert Manifest.from_json(m.to_json()) == m


def test_format_1_is_read_and_written_back_byte_for_byte() -> None:
    v1 = manifest(
        FileEntry("__0_0.distcp", 10, "a" * 64, 0, "n0", algo="sha256"),
        FileEntry(METADATA, 3, "c" * 64, None, "n0", algo="sha256"),
    )
    data = v1.to_json()
    body = json.loads(data)
    assert body["format"] == FORMAT_SHA256 and "hash" not in body
    assert body["files"][0]["sha256"] == "a" * 64
    back = Manifest.from_json(data)
    assert back == v1 and back.to_json() == data  # a copy to another tier keeps its bytes


def test_unknown_formats_and_checksums_and_mixed_files_are_refused() -> None:
    good = json.loads(manifest(FileEntry(METADATA, 3, "00", None, "n0")).to_json())
    for change, why in (
        ({"format": "trainpod-ckpt/9"}, "unknown manifest format 'trainpod-ckpt/9'"),
        ({"hash": "md5"}, "unknown checksum 'md5'"),
    ):
        with pytest.raises(ManifestError, match=why):
            Manifest.from_json(json.dumps({**good, **change}).encode())
    mixed = manifest(
        FileEntry("__0_0.distcp", 10, "00", 0, "n0"),
        FileEntry(METADATA, 3, "c" * 64, None, "n0", algo="sha256"),
    )
    with pytest.raises(ManifestError, match="one checksum"):
        mixed.to_json()


def _to_format_1(step_dir: Path) -> None:
    """Rewrite a committed step's manifest as the first format wrote it (SHA-256)."""
    m = Manifest.from_json((step_dir / MANIFEST).read_bytes())
    files = tuple(
        FileEntry(
            f.name,
            f.size,
            hashlib.sha256((step_dir / f.name).read_bytes()).hexdigest(),
            f.rank,
            f.node,
            algo="sha256",
        )
        for f in m.files
    )
    old = Manifest(m.step, m.world_size, m.nodes, files, m.job, m.attempt, m.created)
    (step_dir / MANIFEST).write_bytes(old.to_json())


def test_a_checkpoint_of_format_1_loads_and_its_corruption_is_found(saved: Path) -> None:
    dirs = step_dirs(saved, 2)
    for d in dirs.values():
        _to_format_1(d)
    flip_byte(dirs["memory"] / "__0_0.distcp")
    step, tier, reasons, state = load(saved)
    assert (step, tier) == (2, "memory+scratch")  # the shard from scratch, verified
    assert torch.equal(state["t"], make_state(2.0)["t"])
    assert any("__0_0.distcp: sha256 mismatch (corrupt)" in r for r in reasons), reasons
