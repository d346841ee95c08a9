"""How often ``trainpod.elastic.run`` copies the state: Young/Daly on the measured costs.

A copy of the state in memory costs ``C`` seconds of the step it is taken before (it is
synchronous). A fault costs the steps since the newest copy every rank holds, half an
interval on average. Copying every ``tau`` seconds of training therefore loses
``C / (tau + C)`` of the time to copies and ``tau / (2 M)`` to redone work, where ``M`` is
the mean time between faults. The sum is least at ``tau = sqrt(2 C M) - C``: Young's
interval (1974), less the copy's own time, which matters only when a copy is not small
beside the interval (Daly's refinement makes the same point). The interval is then rounded
to the whole number of steps, below or above, that loses less. For the GPT example, ``C`` is
3.7 ms, and with a fault every 2 minutes ``tau`` is 0.94 s, about 8 of its steps. A copy
every step costs 3% of the run; this costs about 0.8%.

Every rank must copy at the same steps: a rollback goes to the newest step every rank
holds. So the decision is made from figures that every rank agrees on (``Agreed``: the
largest of each rank's) at fixed points, and it is counted in steps from the step the group
started at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainpod.mtbf import DEFAULT_MTBF_S, young_daly_s

MOST_STEPS = 1000
"""The longest interval in steps, however cheap a copy: bounds the work one fault redoes."""
WARMUP_STEPS = 20
"""Steps copied each time before the costs are known: then the ranks agree on an interval."""


@dataclass(frozen=True)
class Agreed:
    """What every rank agrees on at a decision point: the largest of each rank's figures."""

    copy_s: float  # one copy of the state (0: not measured yet)
    step_s: float  # one step, copies left out (0: not measured yet)
    elapsed_s: float  # since the oldest rank started
    faults: int  # recoveries the oldest rank has been through

    @property
    def measured(self) -> bool:
        return self.copy_s > 0 and self.step_s > 0


def mtbf(elapsed_s: float, faults: int, prior_s: float = DEFAULT_MTBF_S) -> float:
    """The mean time between faults, as seen: ``elapsed / faults``; with none yet, at least
    the prior (and at least as long as it has run without one)."""
    if faults <= 0:
        return max(prior_s, elapsed_s)
    return max(elapsed_s / faults, 1e-3)


def every_steps(agreed: Agreed, prior_mtbf_s: float = DEFAULT_MTBF_S) -> int:
    """Copy every this many steps (1 until the costs are measured)."""
    if not agreed.measured:
        return 1
    m = mtbf(agreed.elapsed_s, agreed.faults, prior_mtbf_s)
    steps = young_daly_s(agreed.copy_s, m) / agreed.step_s
    below = max(1, min(MOST_STEPS, math.floor(steps)))
    above = max(1, min(MOST_STEPS, math.ceil(steps)))
    return min(below, above, key=lambda k: expected_loss(agreed.copy_s, agreed.step_s, m, k))


def expected_loss(copy_s: float, step_s: float, mtbf_s: float, every: int) -> float:
    """The share of the time lost to copies and redone steps when copying every ``every``
    steps (what :func:`every_steps` makes least, for the benchmark's report)."""
    tau = every * step_s
    return copy_s / (tau + copy_s) + tau / (2.0 * mtbf_s)
