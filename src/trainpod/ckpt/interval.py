"""``interval="auto"``: how often to save, from what a save costs and how often faults come.

Young (1974) and Daly (2006): a checkpoint that costs the loop ``C`` seconds, with a mean time
between failures ``M``, loses the least time when taken every ``sqrt(2 C M) - C`` seconds
(:func:`trainpod.ckpt.layout.young_daly_s`). Both inputs are measured, never constants:

* ``C`` is the running median of this process's own ``save()`` stalls (the copy into the
  staging buffers, plus any wait for the previous snapshot to leave them): a median, so one
  slow save (a page-cache flush, a busy core) does not move the cadence, yet a lasting change
  does within half a window;
* ``M`` is what the controller has observed for this job (``TRAINPOD_MTBF_S``, given at each
  launch: docs/decisions/0027), a value or a callable the caller passes, else 4 h.

Before the job's first fault ``M`` is only a guess (the 4 h prior; the controller gives
``TRAINPOD_MTBF_S`` from the first fault on), and a guess that is too high is what made the
demo's first fault redo ~100 steps (ADR 0035). So while ``M`` is the prior the interval is
capped at ``prior_max_s`` (5 s), or at ``stall / prior_overhead`` (1%) when saves are dearer
than that: at most ~5 s of work lost to a first fault, for at most 1% of the loop's time.

The result is bounded: never more often than every ``min_steps`` steps or ``min_s`` seconds,
and never more often than the memory tier can take a snapshot (the median time from a
``save()`` to the memory-tier commit: a save before that would block on the staging
buffers); never less often than every ``max_s`` seconds (a bound on what one fault can cost
when ``M`` is overestimated, as it is before the first fault) or ``max_steps`` steps.

The ranks agree (see :class:`Costs.merge`) on the slowest rank's stall, step time and write
time and on the smallest MTBF, in the gather that commits each save, so every rank computes
the same next step. Everything here is pure apart from the clock it is given.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

from trainpod.ckpt.errors import CheckpointConfigError
from trainpod.ckpt.layout import young_daly_s
from trainpod.clock import Clock

WINDOW = 9
"""Samples in each running median (stalls, memory-tier writes)."""
STEP_WINDOW = 32
"""Step-time samples kept."""


class MonotonicClock:
    """``time.monotonic`` as a :class:`~trainpod.clock.Clock`: step times survive wall-clock
    jumps. Tests pass a :class:`~trainpod.testing.clock.FakeClock` instead."""

    def now(self) -> float:
        return time.monotonic()


@dataclass(frozen=True)
class IntervalBounds:
    """Limits of the automatic interval. Raises :class:`CheckpointConfigError` naming a bad
    value."""

    min_s: float = 1.0
    """Never save more often than this many seconds."""
    max_s: float = 1800.0
    """Always save at least this often (seconds)."""
    min_steps: int = 1
    """Never save more often than every this many steps."""
    max_steps: int | None = None
    """Always save at least every this many steps (None: no limit in steps)."""
    prior_max_s: float | None = 5.0
    """While the MTBF is the prior (no fault observed yet), save at least this often unless
    that costs more than ``prior_overhead`` of the loop's time (None: no such cap)."""
    prior_overhead: float = 0.01
    """The most of the loop's time the ``prior_max_s`` cap may spend on stalls."""

    def __post_init__(self) -> None:
        if not self.min_s >= 0:
            raise CheckpointConfigError(f"min_s must be >= 0 seconds, got {self.min_s!r}")
        if not self.max_s > 0 or self.max_s < self.min_s:
            raise CheckpointConfigError(
                f"max_s must be > 0 and >= min_s ({self.min_s}), got {self.max_s!r}"
            )
        if self.min_steps < 1:
            raise CheckpointConfigError(f"min_steps must be >= 1, got {self.min_steps!r}")
        if self.prior_max_s is not None and not self.prior_max_s > 0:
            raise CheckpointConfigError(
                f"prior_max_s must be > 0 seconds or None, got {self.prior_max_s!r}"
            )
        if not 0 < self.prior_overhead < 1:
            raise CheckpointConfigError(
                f"prior_overhead must be a fraction in (0, 1), got {self.prior_overhead!r}"
            )
        if self.max_steps is not None and self.max_steps < self.min_steps:
            raise CheckpointConfigError(
                f"max_steps must be >= min_steps ({self.min_steps}) or None, got {self.max_steps!r}"
            )


@dataclass(frozen=True)
class Costs:
    """What one rank measured, or (merged) what all ranks agreed on."""

    stall_s: float
    """Median ``save()`` stall."""
    step_s: float
    """Median seconds per training step (saves excluded)."""
    write_s: float
    """Median seconds from a ``save()`` to its memory-tier commit (0: none measured yet)."""
    mtbf_s: float
    """Mean time between failures."""
    prior: bool = False
    """``mtbf_s`` is the prior, not an observed or given value."""

    def merge(self, other: Costs) -> Costs:
        """The slowest rank's costs and the most pessimistic MTBF, a prior if that one is
        (equal MTBFs: if both are; every rank of a job gets the same launch env anyway)."""
        if self.mtbf_s != other.mtbf_s:
            prior = (self if self.mtbf_s < other.mtbf_s else other).prior
        else:
            prior = self.prior and other.prior
        return Costs(
            stall_s=max(self.stall_s, other.stall_s),
            step_s=max(self.step_s, other.step_s),
            write_s=max(self.write_s, other.write_s),
            mtbf_s=min(self.mtbf_s, other.mtbf_s),
            prior=prior,
        )


def interval_s(costs: Costs, bounds: IntervalBounds) -> float:
    """Seconds between saves: Young/Daly within ``[min_s, max_s]``, and at least the time
    the memory tier takes to commit a snapshot."""
    best = young_daly_s(costs.stall_s, costs.mtbf_s)
    most = bounds.max_s
    if costs.prior and bounds.prior_max_s is not None:
        most = min(most, max(bounds.prior_max_s, costs.stall_s / bounds.prior_overhead))
    return max(costs.write_s, min(most, max(bounds.min_s, best)))


def interval_steps(costs: Costs, bounds: IntervalBounds) -> int:
    """:func:`interval_s` in whole steps, within ``[min_steps, max_steps]``."""
    seconds = interval_s(costs, bounds)
    steps = math.ceil(seconds / costs.step_s) if costs.step_s > 0 else bounds.min_steps
    steps = max(bounds.min_steps, steps)
    return steps if bounds.max_steps is None else min(bounds.max_steps, steps)


class RunningMedian:
    """The median of the last ``window`` samples."""

    def __init__(self, window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._samples: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self._samples.append(value)

    def value(self) -> float | None:
        return statistics.median(self._samples) if self._samples else None


class CostMeter:
    """One process's measurements for :class:`Costs`. Step times come from the calls to
    :meth:`step` (once per training step, by the clock), with the time spent in saves taken
    out (:meth:`saved`); stalls and write times are given."""

    def __init__(self, clock: Clock, window: int = WINDOW) -> None:
        self.clock = clock
        self.stalls = RunningMedian(window)
        self.writes = RunningMedian(window)
        self.steps = RunningMedian(STEP_WINDOW)
        self._prev: tuple[int, float] | None = None

    def step(self, step: int) -> None:
        """Step ``step`` has finished (call it once per step)."""
        now = self.clock.now()
        if self._prev is not None and step > self._prev[0]:
            self.steps.add(max(0.0, now - self._prev[1]) / (step - self._prev[0]))
        self._prev = (step, now)

    def saved(self, stall_s: float | None) -> None:
        """A ``save()`` that blocked the loop for ``stall_s`` (None: already added to
        :attr:`stalls`) has just returned. The next step-time sample starts now, so the
        save stays out of it."""
        if stall_s is not None:
            self.stalls.add(stall_s)
        if self._prev is not None:
            self._prev = (self._prev[0], self.clock.now())

    def restart(self) -> None:
        """The loop jumped (a load): the next step starts a new step-time sample."""
        self._prev = None

    def costs(self, mtbf_s: float, *, prior: bool = False) -> Costs | None:
        """This process's costs (``prior``: ``mtbf_s`` is the prior); None until a stall
        and a step time were measured."""
        stall, step = self.stalls.value(), self.steps.value()
        if stall is None or step is None:
            return None
        return Costs(stall, step, self.writes.value() or 0.0, mtbf_s, prior)
