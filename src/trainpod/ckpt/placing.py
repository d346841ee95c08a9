"""The writer's first half: ``dcp.save`` of a staged step into the first tier that takes it.

The targets are the node-local tiers, fastest first (:func:`trainpod.ckpt.fullness.fallbacks`:
memory, then scratch). For each, every rank checks before writing (the leader clears
leftovers of the step; too little free space or a read-only mount refuses the tier), all
ranks agree in one gather, then run ``dcp.save`` together and agree again on the outcome.
A tier that some node found full or unwritable (:func:`~trainpod.ckpt.fullness.unwritable`)
is left, its partial files removed by each node's leader, and the next one is tried by
every rank together: a step is in one tier on every node, so the manifests and the
hand-off stay as they are. Any other failure ends the save (it is not the tier's fault).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainpod.ckpt.coll import Coll
from trainpod.ckpt.fullness import Full, free_bytes, nowhere, unwritable
from trainpod.ckpt.records import Ctx
from trainpod.ckpt.tiers import FsTier

if TYPE_CHECKING:
    from trainpod.ckpt.inplace import FramedFile


@dataclass
class Placed:
    """Where a step went."""

    tier: FsTier
    """The tier written (the last one tried when ``error``)."""
    error: str | None = None
    """None: every rank's files of the step are in ``tier``."""
    full: list[tuple[str, Full]] = field(default_factory=list)
    """(node, tier it found full or unwritable), in the order tried."""
    written: dict[str, tuple[int, str]] = field(default_factory=dict)
    """This rank's files whose (size, checksum) the write computed (no read-back needed)."""
    reused: int = 0
    """How many of them were written over files prepared for them (:mod:`.writefs`)."""
    in_place: int = 0
    """Tensors that were in the step's framed file already (ADR 0053): DCP wrote none."""
    tensors: tuple[int, int] = (0, 0)
    """(tensors this rank staged, tensors its final DCP plan holds): fewer in the plan means
    DCP leaves replicated ones to another rank."""

    def mine(self, node: str) -> list[Full]:
        return [f for n, f in self.full if n == node]


def _dcp_save(
    ctx: Ctx,
    staged: dict[str, Any],
    d: Path,
    tier: FsTier,
    coll: Coll,
    placed: Placed,
    framed: FramedFile | None,
) -> None:
    """``dcp.save`` through :func:`~trainpod.ckpt.writefs.tier_filesystem`: checksums as it
    writes, into the tier's prepared files where it has them. When ``framed`` (the file the
    state was staged into) is this tier's, it moves into the step's directory and its
    tensors are not written again: only their place is recorded (ADR 0053); its checksum is
    one pass over it in memory."""
    import torch.distributed.checkpoint as dcp

    from trainpod.ckpt.inplace import framed_name, inplace_writer
    from trainpod.ckpt.staging import count_tensors
    from trainpod.ckpt.writefs import tier_filesystem, zip_crc_off

    d.mkdir(parents=True, exist_ok=True)
    files = []
    prepared = tier.prepared_dir()
    if framed is not None and prepared is not None and framed.path.parent == prepared:
        framed.move_to(d / framed_name(ctx.rank))
        files.append(framed)
    writer = inplace_writer(d, files, sync_files=tier.sync)
    fs = tier_filesystem(prepared)
    writer.fs = fs
    group = coll.bound()
    with zip_crc_off():
        dcp.save(staged, storage_writer=writer, process_group=group, no_dist=group is None)
    placed.written, placed.reused = dict(fs.written), fs.reused
    placed.in_place, placed.tensors = writer.in_place, (count_tensors(staged), writer.tensors)
    for f in files:
        placed.written[f.path.name] = (f.layout.size, f.crc32c())


def place(
    ctx: Ctx,
    coll: Coll,
    targets: Sequence[FsTier],
    step: int,
    staged: dict[str, Any],
    needed: int,
    framed: FramedFile | None = None,
) -> Placed:
    """Write ``staged`` for ``step`` into the first of ``targets`` that takes it (collective).

    ``needed``: the bytes this node's ranks staged (the pre-check's bar). ``framed``: the
    file ``staged`` lies in (:mod:`trainpod.ckpt.inplace`), used where it is the tier's."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    placed = Placed(targets[0])
    for tier in targets:
        placed.tier, placed.written, placed.reused, placed.in_place = tier, {}, 0, 0
        d = Path(tier.step_dir(step))
        err: str | None = None
        full: Full | None = None
        try:
            if ctx.leader:
                tier.discard(step)  # leftovers of an earlier attempt at this step
            full = unwritable(tier, None, needed)
        except OSError as exc:
            err, full = f"clear {d}: {exc}", unwritable(tier, exc, needed)
        pre = coll.all_gather((err, full, ctx.node))
        if not _took_full(placed, pre):
            errors = [f"rank {r}: {p[0]}" for r, p in enumerate(pre) if p[0]]
            if errors:
                placed.error = "; ".join(errors)
                return placed
            try:
                _dcp_save(ctx, staged, d, tier, coll, placed, framed)
            except (Exception, CheckpointException) as exc:
                err = f"dcp.save into {tier.name}: {str(exc)[:500]}"
                full = unwritable(tier, exc, needed)  # before the partial files go
            post = coll.all_gather((err, full, ctx.node))
            if not any(p[0] for p in post):
                return placed
            if not _took_full(placed, post):
                placed.error = "; ".join(f"rank {r}: {p[0]}" for r, p in enumerate(post) if p[0])
                return placed
        if ctx.leader:  # the partial files in the full tier go; what it had committed stays
            try:
                tier.discard(step)
            except OSError:
                pass
            placed.full = [
                (n, dataclasses.replace(f, free=free_bytes(f.path)) if n == ctx.node else f)
                for n, f in placed.full
            ]
    placed.error = nowhere(f for _, f in placed.full)
    return placed


def _took_full(placed: Placed, gathered: list[tuple[str | None, Full | None, str]]) -> bool:
    """Book the nodes that found the tier full (one entry per node); True if any did."""
    seen = {(n, f.tier) for n, f in placed.full}
    for _, f, node in gathered:
        if f is not None and (node, f.tier) not in seen:
            seen.add((node, f.tier))
            placed.full.append((node, f))
    return any(f is not None for _, f, _ in gathered)
