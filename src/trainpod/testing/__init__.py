"""Fakes that ship with trainpod, for its own tests and for users' tests."""

from trainpod.testing.agents import FakeAgent, FakeGroup, failed_script, make_config
from trainpod.testing.clock import FakeClock

__all__ = ["FakeAgent", "FakeClock", "FakeGroup", "failed_script", "make_config"]
