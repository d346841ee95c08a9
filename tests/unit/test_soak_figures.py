"""The soak's arithmetic (trainpod.testing.soak): growth per hour and what counts as left
behind at rest, on samples made up for the purpose."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest

from trainpod.api.models import AttemptInfo, ChaosRequest, JobInfo
from trainpod.client.http import TrainpodClient
from trainpod.errors import Conflict
from trainpod.testing.soak import (
    MEASURES,
    Native,
    Sample,
    Sampler,
    Soak,
    SoakLedger,
    SoakResult,
    Usage,
    growth_per_hour,
)


def _sample(
    t: float,
    *,
    rss: int = 0,
    fds: int = 20,
    threads: int = 10,
    procs: int = 4,
    spares: int = 0,
    shm: frozenset[str] = frozenset(),
) -> Sample:
    return Sample(
        t=t,
        controller=Usage(rss, fds, threads),
        agents=Usage(0, 40, 20),
        processes=procs,
        spares=spares,
        db_bytes=0,
        shm_bytes=0,
        shm_dirs=shm,
    )


def test_growth_per_hour_is_the_least_squares_slope() -> None:
    steady = [_sample(t * 60, rss=100 + t) for t in range(10)]  # +1 byte a minute
    assert growth_per_hour(steady, lambda s: s.controller.rss_bytes) == pytest.approx(60.0)
    noisy = [_sample(t * 60, rss=100 + (5 if t % 2 else -5)) for t in range(10)]
    assert abs(growth_per_hour(noisy, lambda s: s.controller.rss_bytes)) < 60
    assert growth_per_hour(steady[:2], lambda s: s.controller.rss_bytes) == 0.0
    flat = [_sample(t, rss=7) for t in range(5)]
    assert growth_per_hour(flat, lambda s: s.controller.rss_bytes) == 0.0


def test_native_memory_is_read_from_the_metrics_and_a_missed_read_is_left_out() -> None:
    text = (
        "# TYPE trainpod_process_malloc_bytes gauge\n"
        'trainpod_process_malloc_bytes{kind="in_use"} 1048576\n'
        'trainpod_process_malloc_bytes{kind="free"} 2097152\n'
        'trainpod_process_malloc_bytes{kind="mmap"} 0\n'
        "# TYPE trainpod_process_sqlite_memory_bytes gauge\n"
        "trainpod_process_sqlite_memory_bytes 524288\n"
    )
    assert Native.parse(text) == Native(2**20, 2 * 2**20, 0.0, 2**19)
    assert math.isnan(Native.parse("").malloc_in_use)  # a controller that serves none
    # +1 MiB a minute, one sample not read (the controller restarting): the slope stands
    samples = [
        replace(_sample(t * 60), native=Native(malloc_in_use=(t + 1) * 2**20)) for t in range(6)
    ]
    samples[3] = _sample(180)
    in_use = MEASURES["controller_malloc_in_use_mib"]
    assert growth_per_hour(samples, in_use) == pytest.approx(60.0)
    assert math.isnan(growth_per_hour([_sample(t) for t in range(5)], in_use))  # never read


def test_growth_skips_the_warm_up() -> None:
    # A one-off step in the first quarter (an agent importing torch), flat afterwards.
    samples = [_sample(t * 60, rss=200 if t >= 2 else 0) for t in range(20)]
    result = SoakResult(20, 4, SoakLedger(), samples, samples[0], samples[-1])
    assert result.growth()["controller_rss_mib"] == 0.0
    assert result.growth(warmup=0.0)["controller_rss_mib"] > 0


def test_what_is_left_at_rest_is_named_and_other_clusters_tiers_are_not() -> None:
    before = _sample(0, shm=frozenset({"job-1-other"}))
    clean = _sample(60, fds=24, threads=12, shm=frozenset({"job-1-other"}))
    result = SoakResult(1, 4, SoakLedger(), [before, clean], before, clean)
    assert result.leaks_at_rest() == []
    dirty = _sample(60, fds=40, threads=30, procs=6, shm=frozenset({"job-1-other", "job-7-ab"}))
    leaks = SoakResult(1, 4, SoakLedger(), [before, dirty], before, dirty).leaks_at_rest()
    assert len(leaks) == 4, leaks
    assert "job-7-ab" in leaks[0] and "job-1-other" not in leaks[0]
    assert "4 before, 6 after" in leaks[1]
    assert "20 before, 40 after" in leaks[2] and "10 before, 30 after" in leaks[3]


def test_spares_forked_since_the_baseline_are_not_a_leak_but_more_than_the_zygotes_are() -> None:
    before = _sample(0, procs=4, spares=0)  # the zygotes still importing: no spare yet
    warm = _sample(60, procs=4, spares=4)
    assert SoakResult(1, 4, SoakLedger(), [before, warm], before, warm).leaks_at_rest() == []
    extra = _sample(60, procs=4, spares=5)
    (leak,) = SoakResult(1, 4, SoakLedger(), [before, extra], before, extra).leaks_at_rest()
    assert "spares under the agents: 5" in leak


def test_a_job_not_ended_as_expected_is_a_mismatch() -> None:
    ledger = SoakLedger(
        expected={1: "completed", 2: "cancelled", 3: "completed"},
        kind={1: "train", 2: "cancelled", 3: "short"},
        ended={1: "completed", 2: "failed"},
        reasons={2: "rank 0 exited 1"},
    )
    s = _sample(0)
    assert SoakResult(1, 4, ledger, [s], s, s).mismatches() == [
        "job 2 (cancelled): failed, not cancelled: rank 0 exited 1",
        "job 3 (short): not ended, not completed: ",
    ]


class _Chaos:
    """A client whose chaos calls are refused (409) ``refusals`` times, then accepted."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.sent: list[ChaosRequest] = []

    def chaos(self, req: ChaosRequest) -> None:
        if self.refusals:
            self.refusals -= 1
            raise Conflict("kill-worker needs a running rank on n1; none is")
        self.sent.append(req)


def test_a_fault_the_controller_refuses_is_tried_again_not_a_crash(tmp_path: Path) -> None:
    """A 60-minute soak stopped early on this: the GPT job's ranks had ended between
    the soak's look and its fault (409). The fault is not counted and comes next round."""
    client = _Chaos(refusals=1)
    soak = Soak(
        cast(TrainpodClient, client),
        cast(Sampler, None),
        tmp_path,
        {},
        train_argv=["python", "train.py"],
        faults=("kill-worker",),
    )
    partial: Any = (AttemptInfo.model_construct, JobInfo.model_construct)  # only what it reads
    attempt = partial[0](state="running", nodes=["n1"])
    soak._live[1] = partial[1](id=1, state="running", attempts=[attempt])
    soak.ledger.kind[1] = "train"
    assert soak._inject() is False
    assert (soak.missed, soak.ledger.faults, client.sent) == (1, [], [])
    assert soak._inject() is True
    assert [f for _, _, f, job in soak.ledger.faults] == ["kill-worker"] and client.sent
    assert soak._inject() is False  # once per training job
