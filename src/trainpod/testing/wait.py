"""Polling with a deadline: the way tests wait for a distributed system, never sleep-and-hope."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    pass


def wait_until(
    probe: Callable[[], T | bool | None],
    *,
    timeout_s: float = 30.0,
    interval_s: float = 0.05,
    what: str = "condition",
) -> T:
    """Call ``probe`` until it returns something truthy; return that, or raise after the timeout.

    The message includes the last value seen, so a failing test says where it got stuck.
    """
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        last = probe()
        if last:
            return last  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}; last: {last!r}")
        time.sleep(interval_s)
