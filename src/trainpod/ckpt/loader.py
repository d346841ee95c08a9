"""``load_latest``: the newest intact committed checkpoint, each file from the fastest copy.

Each rank reads only what its DCP load plan needs: ``.metadata`` and the data files that
hold its shards (for replicated state, a file another rank wrote). For the newest step any
rank sees, a rank routes every file it needs to the fastest tier copy that holds it intact
(size and SHA-256 against the manifest): its own node's memory, then scratch, then a peer
copy (near ones first), then the durable store. Ranks load only when every rank routed
every file (one all-gather on the dedicated group); otherwise the reasons are recorded and
the previous step is tried. A torn or corrupt checkpoint is never loaded.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from trainpod.ckpt.coll import Coll
from trainpod.ckpt.manifest import METADATA, Manifest, hash_stream
from trainpod.ckpt.records import Ctx
from trainpod.ckpt.staging import to_state_dict
from trainpod.ckpt.tiers import Location, Tier

log = logging.getLogger(__name__)
Route = tuple[Tier, Location]


@dataclass(frozen=True)
class LoadResult:
    """What :meth:`Checkpointer.load_latest` did on this rank."""

    step: int | None
    """The step loaded (the same on every rank); None on a fresh start."""
    tier: str | None
    """The tier(s) this rank read from, fastest first, joined by ``+`` (``"memory+peer"``)."""
    reasons: tuple[str, ...]
    """Why newer checkpoints or faster copies were passed over (every rank's), one a line."""
    seconds: float


def needed_files(state: Mapping[str, Any], metadata: Any) -> set[str]:
    """The files DCP's default load plan reads for this rank's ``state``.

    Raises whatever the planner raises when the state does not fit the checkpoint.
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    planner = DefaultLoadPlanner()
    planner.set_up_planner(to_state_dict(state), metadata, is_coordinator=False)
    plan = planner.create_local_plan()
    return {metadata.storage_data[item.storage_index].relative_path for item in plan.items}


def _holds(tier: Tier, loc: Location, manifest: Manifest, name: str) -> bool:
    entry = manifest.entry(name)
    if entry is None:
        return False
    return not tier.node_scoped or entry.rank is None or entry.node == loc.origin


def _intact(tier: Tier, loc: Location, manifest: Manifest, name: str, verify: bool) -> str | None:
    """None when the copy matches the manifest, else what is wrong with it."""
    entry = manifest.entry(name)
    assert entry is not None
    try:
        with tier.open(loc, name) as f:
            size, digest = hash_stream(f, entry.algo) if verify else (f.seek(0, 2), entry.digest)
    except FileNotFoundError:
        return f"{name}: missing"
    except Exception as exc:  # an unreachable store, a permission error
        return f"{name}: {type(exc).__name__}: {exc}"
    if size != entry.size:
        return f"{name}: {size} bytes, manifest says {entry.size} (truncated or torn)"
    if digest != entry.digest:
        return f"{name}: {entry.algo} mismatch (corrupt)"
    return None


class _Plan:
    """One rank's routing of one step: every needed file to an intact copy, or why not."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.problems: list[str] = []
        self.fatal: str | None = None


def _route(
    step: int,
    copies: Sequence[Route],
    state: Mapping[str, Any],
    verify: bool,
) -> _Plan:
    plan = _Plan()
    manifests: dict[int, Manifest] = {}
    for i, (tier, loc) in enumerate(copies):
        try:
            manifests[i] = Manifest.from_json(tier.read_manifest(loc))
        except Exception as exc:  # any store error: OSError, botocore's, fsspec's
            plan.problems.append(f"{tier.name} {loc.path}: manifest: {exc}")
    usable = [(i, t, loc) for i, (t, loc) in enumerate(copies) if i in manifests]

    def route(name: str) -> bool:
        for i, tier, loc in usable:
            if not _holds(tier, loc, manifests[i], name):
                continue
            why = _intact(tier, loc, manifests[i], name, verify)
            if why is None:
                plan.routes[name] = (tier, loc)
                return True
            plan.problems.append(f"{tier.name}: {why}")
        return False

    if not route(METADATA):
        plan.fatal = "no intact .metadata"
        return plan
    tier, loc = plan.routes[METADATA]
    try:
        with tier.open(loc, METADATA) as f:
            metadata = pickle.loads(f.read())  # DCP's format; FileSystemReader unpickles it
    except Exception as exc:  # the store went away since the check, or a bad pickle
        plan.fatal = f".metadata: {type(exc).__name__}: {exc}"
        return plan
    try:
        needed = needed_files(state, metadata)
    except Exception as exc:
        plan.fatal = f"state does not fit the checkpoint: {type(exc).__name__}: {exc}"
        return plan
    missing = [name for name in sorted(needed) if not route(name)]
    if missing:
        plan.fatal = f"no intact copy of {', '.join(missing)}"
    return plan


def _reader(routes: Mapping[str, Route]) -> Any:
    """A DCP FileSystemReader whose files come from the routed copies (local or fsspec)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystemBase

    class Routed(FileSystemBase):  # type: ignore[misc]  # torch is not analysed (config)
        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
            tier, loc = routes[str(path)]
            with tier.open(loc, str(path)) as f:
                yield f

        def concat_path(self, path: Any, suffix: str) -> str:
            return suffix

        def init_path(self, path: Any) -> Any:
            return path

        def rename(self, path: Any, new_path: Any) -> None:
            raise OSError("read-only")

        def mkdir(self, path: Any) -> None:
            raise OSError("read-only")

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

        def exists(self, path: Any) -> bool:
            return str(path) in routes

        def rm_file(self, path: Any) -> None:
            raise OSError("read-only")

    reader = FileSystemReader("routed")
    reader.fs = Routed()
    return reader


def load_latest(
    ctx: Ctx, coll: Coll, tiers: Sequence[Tier], state: dict[str, Any], *, verify: bool = True
) -> LoadResult:
    """Load the newest intact committed checkpoint into ``state`` in place. Collective.

    Blocking. Never raises for a bad checkpoint (it becomes a reason); raises only when the
    group itself fails.
    """
    import torch.distributed.checkpoint as dcp

    t0 = time.monotonic()
    notes: list[str] = []
    copies: dict[int, list[Route]] = {}
    for tier in tiers:
        try:
            locs, why = tier.locate()
        except Exception as exc:
            locs, why = [], [f"{tier.name}: cannot list: {type(exc).__name__}: {exc}"]
        notes += why
        for loc in sorted(locs, key=lambda x: x.origin != ctx.node):  # near copies first
            copies.setdefault(loc.step, []).append((tier, loc))
    seen = coll.all_gather((sorted(copies), notes))
    reasons = [f"rank {r}: {n}" for r, (_, ns) in enumerate(seen) for n in ns]
    for step in sorted({s for steps, _ in seen for s in steps}, reverse=True):
        plan = _route(step, copies.get(step, []), state, verify)
        verdicts = coll.all_gather((plan.fatal, plan.problems))
        for r, (fatal, problems) in enumerate(verdicts):
            reasons += [f"step {step} rank {r}: passed over {p}" for p in problems]
            if fatal:
                reasons.append(f"step {step} rank {r}: {fatal}")
        if any(fatal for fatal, _ in verdicts):
            continue
        err = None
        try:
            group = coll.bound()
            dcp.load(state, storage_reader=_reader(plan.routes), process_group=group,
                     no_dist=group is None)  # fmt: skip
        except Exception as exc:
            err = f"dcp.load: {type(exc).__name__}: {exc}"
        failed = [f"step {step} rank {r}: {e}" for r, e in enumerate(coll.all_gather(err)) if e]
        if failed:
            reasons += failed
            continue
        used = [t.name for t in tiers if any(rt is t for rt, _ in plan.routes.values())]
        return LoadResult(step, "+".join(used), tuple(reasons), time.monotonic() - t0)
    return LoadResult(None, None, tuple(reasons), time.monotonic() - t0)
