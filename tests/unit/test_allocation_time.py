"""An allocation's --time, read as Slurm reads it."""

from __future__ import annotations

import math

import pytest

from trainpod.controller.allocations import time_limit_s
from trainpod.spec.job import JobSpec


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("90", 90 * 60),
        ("5:30", 5 * 60 + 30),
        ("1:02:03", 3600 + 2 * 60 + 3),
        ("2-3", 2 * 86400 + 3 * 3600),
        ("2-3:04", 2 * 86400 + 3 * 3600 + 4 * 60),
        ("2-3:04:05", 2 * 86400 + 3 * 3600 + 4 * 60 + 5),
    ],
)
def test_slurm_time_formats(text: str, seconds: int) -> None:
    assert time_limit_s(text) == seconds


def test_unlimited_is_forever() -> None:
    assert math.isinf(time_limit_s("UNLIMITED")) and math.isinf(time_limit_s("INFINITE"))


def test_time_is_an_allocations_own_on_the_embedded_backend_not_a_slurm_only_option() -> None:
    assert JobSpec(command=["x"], time_limit="10", interactive=True).slurm_only() == []
    assert JobSpec(command=["x"], time_limit="10").slurm_only() == ["--time"]
