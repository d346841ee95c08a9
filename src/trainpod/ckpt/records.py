"""Plain records shared by the checkpoint modules."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainpod.ckpt.inplace import FramedFile
    from trainpod.ckpt.interval import Costs

EventHook = Callable[[str, int], None]
"""Called with (event, step) from the background threads: ``written`` (this rank's DCP files
are in the primary tier, manifest not yet), ``committed:<tier>``, ``failed:<tier>``."""


@dataclass(frozen=True)
class Ctx:
    """Who this rank is."""

    rank: int
    world_size: int
    node: str
    nodes: tuple[str, ...]
    leader: bool
    """The lowest rank on this node: writes the node's ``.metadata`` and manifests."""
    job: str = ""
    attempt: int = 1


@dataclass
class Snapshot:
    step: int
    staged: dict[str, Any]
    proposal: Costs | None = None
    """This rank's measured costs, for the agreed automatic interval (None: not measured
    yet, or a fixed interval)."""
    stall_s: float | None = None
    """How long this rank's ``save`` blocked for this snapshot (up to the hand-over)."""
    submitted: float = field(default_factory=time.monotonic)
    nbytes: int = 0
    """Bytes of tensors this rank staged (what its files will need, about)."""
    framed: FramedFile | None = None
    """The memory tier's framed file the state was staged into (ADR 0053): its tensors are
    in ``staged``; the writer moves it into the step's directory, or removes it."""


@dataclass(frozen=True)
class Progress:
    """Where the background work stands (see :meth:`Checkpointer.progress`)."""

    committed: dict[str, int | None]
    """Newest step committed in each tier by this Checkpointer (None: none yet)."""
    copying_step: int | None
    copying_tier: str | None
    bytes_done: int
    bytes_total: int
    rate_bps: float
    pending_snapshots: int
    """Snapshots taken but not yet committed to the primary tier."""
    errors: dict[str, str]
    """The last error per tier, until that tier commits again."""
    retry_in_s: float | None
    """Seconds until the next retry of a failed durable copy; None when none is due."""
    steps_skipped: dict[str, int] = field(default_factory=dict)
    """Copy tier -> steps committed in the primary tier that it never got, because a newer
    step went instead (a tier slower than the saves keeps up by skipping)."""
