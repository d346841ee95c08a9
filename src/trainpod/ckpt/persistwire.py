"""The persister's wire: the hand-off requests it reads and the lines it writes.

The agent writes :class:`Request` s (JSON lines, the ``persist`` request of
:mod:`trainpod.ckpt.handoff`) to the persister's stdin and reads its reports with
:func:`parse_line`. This module imports pydantic: only the agent and the persister import
it, never a worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from trainpod.ckpt.handoff import PersistStatus, TierConfig


@dataclass(frozen=True)
class Request:
    """One hand-off: persist ``step`` of this job (the newest step wins). On the wire: the
    ``persist`` request of :mod:`trainpod.ckpt.handoff` (parse it with :func:`parse_request`).
    Raises ``ValueError`` for a negative step or a non-positive ``retry_base_s``."""

    step: int
    config: Annotated[TierConfig, Field(alias="tiers")]
    job_id: int | None = None
    attempt_id: int | None = None
    retry_base_s: float = 1.0
    durable: bool = True
    """Whether the step goes to the global tiers too (the workers decided it together: see
    :class:`Persister`); node tiers take every step."""
    stall_s: float | None = None
    """How long the save stalled training (the agent reports it with the saved step)."""
    nbytes: Annotated[int, Field(alias="bytes")] = 0
    """The size of this node's part of the step."""
    source: str | None = None
    """The tier the step was written into when not the primary (it was full: 0036); the
    copies start from there and go to the tiers after it."""

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"step must be a non-negative int, got {self.step!r}")
        if not self.retry_base_s > 0:
            raise ValueError(f"retry_base_s must be a positive number, got {self.retry_base_s!r}")


@dataclass(frozen=True)
class TierFull:
    """A tier could not take a step on one node (the ``tier_full`` request of
    :mod:`trainpod.ckpt.handoff`; docs/decisions/0036)."""

    step: int
    tier: str
    path: str
    reason: str
    needed: int
    free: int | None
    to: str | None
    """The tier the step went to instead; None: no tier took it."""
    job_id: int | None = None
    attempt_id: int | None = None
    error: str = ""
    """When no tier took it: every tier tried, with its free space."""


@dataclass(frozen=True)
class PersistReport:
    """A copy of a step to one tier committed or failed: a line on the persister's stdout."""

    event: Literal["committed", "failed"]
    tier: str
    """The tier, or "config" when the tiers could not be built."""
    step: int
    job_id: int | None = None
    attempt_id: int | None = None
    bytes: int = 0
    seconds: float = 0.0
    since_save_s: float | None = None
    """Committed: how long after the save of the step (the manifest's time)."""
    reason: str = ""
    """Failed: why."""
    wrote_manifest: bool = False
    """Committed to a global tier: this node wrote the manifest (the commit) itself."""
    skipped: int = 0
    """Committed: steps of the memory tier this tier skipped since its previous commit."""


@dataclass(frozen=True)
class StatusReport:
    """The persister's status: after each change (``status``) and as its last line (``exited``)."""

    event: Literal["status", "exited"]
    status: PersistStatus


@dataclass(frozen=True)
class Started:
    """The persister holds the job's lock and starts on the requests."""

    event: Literal["started"]
    pid: int


PersisterLine = PersistReport | StatusReport | Started
_REQUEST: TypeAdapter[Request] = TypeAdapter(Request)
_TIER_FULL: TypeAdapter[TierFull] = TypeAdapter(TierFull)
_LINE: TypeAdapter[PersisterLine] = TypeAdapter(
    Annotated[PersisterLine, Field(discriminator="event")]
)


def parse_request(data: str | bytes) -> Request:
    """A ``persist`` request from its JSON (unknown keys are ignored). Raises ``ValueError``
    (pydantic's ``ValidationError``) naming each bad field."""
    return _REQUEST.validate_json(data, strict=True)


def parse_tier_full(data: str | bytes) -> TierFull:
    """A ``tier_full`` request from its JSON. Raises ``ValueError`` naming each bad field."""
    return _TIER_FULL.validate_json(data, strict=True)


def parse_line(data: str | bytes) -> PersisterLine:
    """One line of the persister's stdout. Raises ``ValueError`` for anything else."""
    return _LINE.validate_json(data, strict=True)
