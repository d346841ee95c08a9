"""Errors of the checkpoint library; all derive from :class:`trainpod.errors.TrainpodError`."""

from __future__ import annotations

from trainpod.errors import Fatal, TrainpodError


class CheckpointError(TrainpodError):
    """A checkpoint operation failed."""


class CheckpointConfigError(CheckpointError, Fatal):
    """The checkpoint locations or options are unusable; the message says what to change."""


class ManifestError(CheckpointError):
    """A manifest is missing, unreadable or inconsistent (the checkpoint is not committed)."""
