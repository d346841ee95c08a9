"""Moved to :mod:`trainpod.model.states`; this re-export keeps old imports working until
every module imports the model package directly."""

from trainpod.model.states import *  # noqa: F403
from trainpod.model.states import (
    ATTEMPT_TRANSITIONS,
    JOB_TRANSITIONS,
    NODE_TRANSITIONS,
    AttemptState,
    IllegalTransition,
    JobState,
    NodeState,
    RankState,
    check,
)

__all__ = [
    "ATTEMPT_TRANSITIONS",
    "JOB_TRANSITIONS",
    "NODE_TRANSITIONS",
    "AttemptState",
    "IllegalTransition",
    "JobState",
    "NodeState",
    "RankState",
    "check",
]
