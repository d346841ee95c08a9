"""The decentralised durable commit of a checkpoint: every node's part marker, and the
manifest written by whoever sees the last one (see :mod:`trainpod.ckpt.persist`).

A global tier holds every node's part of a step. Each node's persister uploads its part,
then writes ``parts/<node>.json`` atomically (node, step and the SHA-256 of the manifest,
byte-identical on every node); whoever then finds a valid marker from every node that owns
files writes ``manifest.json``: the same bytes, so concurrent writers are harmless.
"""

from __future__ import annotations

import hashlib
import json

from trainpod.ckpt.errors import ManifestError
from trainpod.ckpt.manifest import MANIFEST, METADATA, Manifest
from trainpod.ckpt.tiers import FsTier

PART_FORMAT = "trainpod-ckpt-part/1"
PARTS = "parts"


def manifest_digest(m: Manifest) -> str:
    return hashlib.sha256(m.to_json()).hexdigest()


def parts_needed(m: Manifest) -> set[str]:
    """The nodes whose part a global tier needs: every node with data files, and the node
    whose ``.metadata`` entry it is (that node uploads it)."""
    needed = {f.node for f in m.files if f.rank is not None}
    meta = m.entry(METADATA)
    if meta is not None:
        needed.add(meta.node)
    return needed


def global_names(m: Manifest, node: str) -> list[str]:
    """The files ``node`` uploads to a global tier: its ranks' files (and ``.metadata`` when
    the manifest names it as its writer, so exactly one node writes each file)."""
    names = [f.name for f in m.files if f.rank is not None and f.node == node]
    meta = m.entry(METADATA)
    if meta is not None and meta.node == node:
        names.append(METADATA)
    return names


def part_path(tier: FsTier, step: int, node: str) -> str:
    return f"{tier.step_dir(step)}/{PARTS}/{node}.json"


def write_part(tier: FsTier, m: Manifest, node: str) -> None:
    """Say atomically that ``node``'s part of ``m`` is in ``tier`` (after uploading it)."""
    body = {"format": PART_FORMAT, "node": node, "step": m.step, "manifest": manifest_digest(m)}
    tier.write_whole(part_path(tier, m.step, node), json.dumps(body).encode())


def has_part(tier: FsTier, m: Manifest, node: str) -> bool:
    """Whether ``tier`` holds a valid marker of ``node``'s part of exactly ``m``. A missing,
    torn or foreign marker (another attempt's checkpoint of the same step) is not one."""
    try:
        body = json.loads(tier.fs.cat_file(part_path(tier, m.step, node)))
    except FileNotFoundError:
        return False
    except ValueError:
        return False
    return (
        isinstance(body, dict)
        and body.get("format") == PART_FORMAT
        and body.get("node") == node
        and body.get("step") == m.step
        and body.get("manifest") == manifest_digest(m)
    )


def is_committed(tier: FsTier, m: Manifest) -> bool:
    """Whether ``tier`` has ``m`` itself committed (not another attempt's same step)."""
    try:
        data = bytes(tier.fs.cat_file(f"{tier.step_dir(m.step)}/{MANIFEST}"))
        return Manifest.from_json(data) == m
    except (FileNotFoundError, ManifestError):
        return False


def try_commit(tier: FsTier, m: Manifest) -> bool:
    """Commit ``m`` to the global ``tier`` if every needed part is there; True once it is
    committed (by this call or by another node's). Idempotent; raises what the store raises."""
    if is_committed(tier, m):
        return True
    if not all(has_part(tier, m, n) for n in sorted(parts_needed(m))):
        return False
    tier.commit(m.step, m)
    return True
