"""The mean time between faults, and the interval between copies of the state it calls for
(Young/Daly). Shared by the checkpointer's ``interval="auto"`` (``trainpod.ckpt``) and
``trainpod.elastic.run``'s in-memory copies: a leaf, importing nothing of trainpod's."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

DEFAULT_MTBF_S = 4 * 3600.0
"""Mean time between failures assumed when nothing else is known."""


def mtbf_s(explicit: float | None, env: Mapping[str, str] | None = None) -> float:
    """The MTBF for ``interval="auto"``: the argument, else ``TRAINPOD_MTBF_S``, else 4 h."""
    if explicit is not None:
        return float(explicit)
    raw = (os.environ if env is None else env).get("TRAINPOD_MTBF_S", "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_MTBF_S
    return value if value > 0 else DEFAULT_MTBF_S


def mtbf_is_prior(env: Mapping[str, str] | None = None) -> bool:
    """Whether :func:`mtbf_s` without an argument gives the 4 h prior (no usable
    ``TRAINPOD_MTBF_S``: the controller gives one once the cluster has seen a fault)."""
    raw = (os.environ if env is None else env).get("TRAINPOD_MTBF_S", "")
    try:
        return not float(raw) > 0
    except ValueError:
        return True


def young_daly_s(stall_s: float, mtbf: float) -> float:
    """Optimal seconds between checkpoints (Young 1974, Daly 2006).

    sqrt(2 * stall * mtbf) - stall while stall < 2 * mtbf, else mtbf.
    """
    if stall_s <= 0:
        return mtbf
    if stall_s >= 2 * mtbf:
        return mtbf
    return max(stall_s, math.sqrt(2 * stall_s * mtbf) - stall_s)
