"""Tiered asynchronous checkpoints with a verified commit protocol, on PyTorch DCP.

::

    ckpt = trainpod.Checkpointer()            # under trainpod: locations from the environment
    ckpt = trainpod.Checkpointer(dir="ckpt")  # anywhere else: a directory or fsspec URL
    start = ckpt.load_latest(state)           # newest intact committed step, or None
    for step in range(start or 0, steps):
        ...
        if ckpt.due(step):
            ckpt.save(step, state)            # returns after the copy into staging memory
    ckpt.close()                              # waits for the copies in flight

How a save travels (``pipeline``): the training thread copies the state into reused staging
buffers (pinned host memory for CUDA tensors) and returns; a writer thread runs ``dcp.save``
into the node's shared-memory tier (``/dev/shm/trainpod/<job>/<node>/step-N``, files that
outlive the worker) on its own Gloo group, hashes each rank's files and commits. Under
trainpod the node leader then hands the step to the node's agent (``handoff``), whose
persister process (``persist``; it survives the worker) copies the node's part to the node's
scratch dir, to the next node's scratch dir (peer) and to the durable store (fsspec), where
the nodes' parts commit without any collective (part markers, then the manifest). Without an
agent a copier thread (another Gloo group) does the same in-process, committing each tier
with a gather. Durable copies are retried with backoff. Retention keeps K steps per tier.

The commit protocol (``manifest``): a checkpoint counts in a tier only once every rank's
files are there and ``manifest.json`` (step, world size, nodes, every file's size, SHA-256,
rank and node) has been written atomically after an all-gather confirmed all parts; the
tier's ``latest`` moves after that. ``load_latest`` (``loader``) routes each file a rank's
DCP load plan needs to the fastest copy that verifies, falls back tier by tier and then
step by step, records why, and loads only when every rank has all it needs. A restart on
another world size reshards (DCP load planning) from whatever copies hold the shards.

Importing this package is cheap: torch and fsspec load when a Checkpointer is first used.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: `import trainpod` must not pay for typing
if TYPE_CHECKING:
    from typing import Any

    from trainpod.ckpt.checkpointer import Checkpointer, default_tiers
    from trainpod.ckpt.errors import CheckpointConfigError, CheckpointError, ManifestError
    from trainpod.ckpt.interval import Costs, IntervalBounds
    from trainpod.ckpt.loader import LoadResult
    from trainpod.ckpt.manifest import FileEntry, Manifest
    from trainpod.ckpt.records import Progress
    from trainpod.ckpt.tiers import FsTier, Location, Meter, PeerTier, Tier

__all__ = [
    "CheckpointConfigError",
    "CheckpointError",
    "Checkpointer",
    "Costs",
    "FileEntry",
    "FsTier",
    "IntervalBounds",
    "LoadResult",
    "Location",
    "Manifest",
    "ManifestError",
    "Meter",
    "PeerTier",
    "Progress",
    "Tier",
    "default_tiers",
]

_WHERE = {
    "Checkpointer": "checkpointer",
    "default_tiers": "checkpointer",
    "CheckpointConfigError": "errors",
    "CheckpointError": "errors",
    "ManifestError": "errors",
    "Costs": "interval",
    "IntervalBounds": "interval",
    "LoadResult": "loader",
    "FileEntry": "manifest",
    "Manifest": "manifest",
    "Progress": "records",
    "FsTier": "tiers",
    "Location": "tiers",
    "Meter": "tiers",
    "PeerTier": "tiers",
    "Tier": "tiers",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'trainpod.ckpt' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"trainpod.ckpt.{module}"), name)


def _trainpod_getattr(name: str) -> type[Checkpointer]:
    """``trainpod.__getattr__``: makes ``trainpod.Checkpointer`` lazy (no torch at import).

    Typed for ``Checkpointer``, the one name it serves (type checkers read the return type).
    """
    if name == "Checkpointer":
        cls: type[Checkpointer] = __getattr__(name)
        return cls
    raise AttributeError(f"module 'trainpod' has no attribute {name!r}")
