"""Fakes that ship with trainpod, for its own tests and for users' tests."""

from trainpod.testing.clock import FakeClock

__all__ = ["FakeClock"]
