"""Device telemetry: the agent's sampler over the SIMULATED reader, and the controller's
rings and energy book (on a real SQLite store)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainpod.agent.devices import SIM_IDLE_W, DeviceTelemetry, SimulatedReader
from trainpod.agent.health.simgpu import inject
from trainpod.api.devices import DeviceSample
from trainpod.controller.telemetry import Holder, TelemetryBook
from trainpod.store.energy import Energy
from trainpod.store.repo import Store
from trainpod.testing import FakeClock


def sampler(count: int = 2, state: Path | None = None) -> tuple[DeviceTelemetry, FakeClock]:
    clock = FakeClock()
    return DeviceTelemetry(SimulatedReader(count, state, clock.now), clock=clock.now), clock


def test_simulated_samples_follow_the_ranks_and_say_they_are_simulated() -> None:
    tel, clock = sampler()
    idle = tel.samples(busy=set())
    assert [s.index for s in idle] == [0, 1]
    assert all(s.simulated and s.energy_source == "simulated" for s in idle)
    assert all("SIMULATED" in s.name for s in idle)
    assert {s.utilization_pct for s in idle} == {0.0}
    assert {s.power_w for s in idle} == {SIM_IDLE_W}
    clock.advance(1.0)
    busy = tel.samples(busy={1})
    assert busy[0].utilization_pct == 0.0
    util = busy[1].utilization_pct
    assert util is not None and util > 80
    assert busy[1].power_w is not None and busy[1].power_w > 500
    mem, total = busy[1].memory_used_bytes, busy[1].memory_total_bytes
    assert mem is not None and total is not None and 0 < mem < total


def test_energy_is_power_integrated_over_time_where_there_is_no_counter() -> None:
    tel, clock = sampler(count=1)
    assert tel.samples(set())[0].energy_j == 0.0
    clock.advance(10.0)
    assert tel.samples(set())[0].energy_j == pytest.approx(10.0 * SIM_IDLE_W)
    clock.advance(10.0)
    assert tel.samples(set())[0].energy_j == pytest.approx(20.0 * SIM_IDLE_W)


def test_a_burst_of_beats_reuses_the_last_reading() -> None:
    tel, clock = sampler(count=1)
    first = tel.samples(set())
    clock.advance(0.2)
    assert tel.samples({0}) is first  # under min_interval_s: not read again
    clock.advance(1.0)
    assert tel.samples({0})[0].t > first[0].t


def test_injected_faults_show_in_the_samples(tmp_path: Path) -> None:
    state = tmp_path / "simgpu.json"
    tel, clock = sampler(count=2, state=state)
    assert [s.xid_count for s in tel.samples(set())] == [0, 0]
    inject(state, "xid79", gpu=1)
    inject(state, "xid13", gpu=1)
    inject(state, "thermal", gpu=0)
    clock.advance(1.0)
    s0, s1 = tel.samples(set())
    assert (s0.xid_count, s1.xid_count) == (0, 2)
    assert s0.temperature_c == 92.0 and "hw_thermal" in s0.throttle_reasons
    clock.advance(1.0)
    assert [s.xid_count for s in tel.samples(set())] == [0, 2]  # a count, not re-added


def sample(index: int, t: float, energy: float | None, simulated: bool = True) -> DeviceSample:
    return DeviceSample(index=index, t=t, simulated=simulated, energy_j=energy, power_w=100.0)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.open(tmp_path / "state.db")


def test_the_ring_is_bounded_and_skips_repeats(store: Store) -> None:
    book = TelemetryBook(store, ring=5)
    for t in range(8):
        book.record("n0", [sample(0, float(t), None)], Holder(), float(t))
    book.record("n0", [sample(0, 7.0, None)], Holder(), 8.0)  # the same reading again
    (dev,) = book.of("n0")
    assert [p.t for p in dev.samples] == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert dev.simulated
    book.keep_only({"n1"})
    assert book.of("n0") == []


def test_energy_deltas_go_to_the_holder_and_survive_in_the_store(store: Store) -> None:
    book = TelemetryBook(store, flush_s=5.0)
    job = Holder(job_id=7, attempt=1)
    book.record("n0", [sample(0, 0.0, 1000.0), sample(1, 0.0, 50.0)], job, 0.0)
    book.record("n0", [sample(0, 1.0, 1600.0), sample(1, 1.0, 80.0)], job, 1.0)
    book.flush(1.0)  # the first flush writes at once
    assert book.unflushed(7) == 0.0
    book.record("n0", [sample(0, 2.0, 100.0)], job, 2.0)  # counter went down: nothing
    book.record("n0", [sample(0, 3.0, 400.0)], Holder(), 3.0)  # no job holds it: job 0
    book.flush(3.0)
    assert book.unflushed(0) == pytest.approx(300.0)  # under flush_s since the last write
    book.flush(6.5)
    assert book.unflushed(0) == 0.0
    with store.transaction():
        per_job = Energy(store).per_job()
    assert per_job[7].joules == pytest.approx(630.0) and per_job[7].simulated
    assert per_job[0].joules == pytest.approx(300.0)
    book.record("n0", [sample(0, 4.0, 700.0, simulated=False)], job, 4.0)
    book.flush(20.0)
    with store.transaction():
        rows = Energy(store).of_job(7)
    assert [(r.attempt, r.node, round(r.joules)) for r in rows] == [(1, "n0", 930)]
    assert rows[0].simulated  # some of its joules were simulated
