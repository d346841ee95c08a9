"""How many jobs ran or waited at once under the controller kill load, from the stored
spans (``trainpod.testing.killload.at_once``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainpod.client.http import TrainpodClient
from trainpod.testing.killload import KillLoad, at_once


def test_counts_live_attempts_each_second_of_the_load() -> None:
    attempts: list[tuple[float, float | None]] = [
        (100.0, None),  # a long job, never ended
        (100.5, 102.5),
        (101.0, 101.2),  # ended between two samples: not seen
        (102.0, 104.0),
        (90.0, 100.0),  # ended as the load began: ended at t is not live at t
        (104.0, 110.0),
    ]
    # samples at 100, 101, 102, 103, 104: 1, 2, 3, 2, 2
    running = at_once("running", attempts, start=100.0, end=104.5)
    assert running is not None
    assert (running.median, running.p10, running.max, running.seconds) == (2, 1, 3, 5)
    assert str(running) == "jobs running at once: median 2, p10 1, max 3 (over 5 s)"


def test_no_load_no_figure() -> None:
    assert at_once("queued", [(1.0, 2.0)], start=5.0, end=5.0) is None


def test_a_true_fraction_outside_zero_to_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"true_fraction must be between 0 and 1, not 1\.5"):
        KillLoad(
            lambda: None,
            lambda: [],
            TrainpodClient("http://127.0.0.1:1", "no-token"),
            tmp_path,
            {},
            queued=10,
            long_jobs=0,
            true_fraction=1.5,
        )
