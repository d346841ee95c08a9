"""How a preempted job is told to stop: ``preemption:`` in the cluster spec."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from trainpod.notice import DEFAULT_SIGNAL, parse_signal
from trainpod.scheduler.policy import DEFAULT_MIN_RUN_S

Seconds = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # as in spec.cluster


class PreemptionPolicy(BaseModel):
    """The notice a preempted job gets before it is torn down, and who may be preempted."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    signal: StrictStr = DEFAULT_SIGNAL
    """Signal sent to every rank's process group as the notice (``trainpod.preempted()``
    turns True). Ranks start with it ignored, so a script that never asks is not killed by
    it. A name: SIGUSR1, SIGUSR2 or SIGHUP (``USR1`` works too)."""
    grace_s: Seconds = Field(default=30.0, ge=0)
    """Seconds between the notice and teardown (SIGTERM, then SIGKILL after
    ``recovery.teardown_grace_s``): the time a script has to save a checkpoint and exit."""
    min_run_s: Seconds = Field(default=DEFAULT_MIN_RUN_S, ge=0)
    """Seconds a job runs before the scheduler may choose it as a victim (Slurm's
    ``PreemptExemptTime``). Default 120: a job preempted at once loses its whole start-up
    and has no checkpoint yet, so a stream of higher-priority arrivals would make it thrash;
    a preemptor whose only victims are that young waits for them (at most this long). 0
    makes every running job a victim at once, as Slurm does by default."""
    lend_reserved: StrictBool = True
    """Backfill past a reservation: a preemptible job that fits nodes a waiting job has
    reserved, but whose ``--time`` (or none) reaches past that job's expected start, may
    start on them when that start is at least ``max(min_run_s, grace_s)`` away; the waiting
    job preempts it (with this notice) once it can start. False: such a job waits, as under
    Slurm's backfill. See docs/decisions/0050-backfill-past-reservations.md."""

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, value: str) -> str:
        from trainpod.spec.cluster import _problem  # cluster.py imports this module

        try:
            return parse_signal(value).name
        except ValueError as exc:
            reason, _, fix = str(exc).rpartition("; ")
            raise _problem(reason, value, fix) from None
