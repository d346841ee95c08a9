"""``/metrics`` over a real controller: what Prometheus would read, and who may read it.

Parsed with prometheus_client's own parser. The devices are SIMULATED (the agent's real
sampler over its simulated reader)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from trainpod.agent.devices import DeviceTelemetry, SimulatedReader
from trainpod.api.app import create_app
from trainpod.api.models import ClusterInfo
from trainpod.controller.access import operator
from trainpod.controller.core import Controller
from trainpod.controller.metrics import ClusterMetrics
from trainpod.errors import StoreUnavailable
from trainpod.store.goodput import EndedGoodput, EndedGoodputRow
from trainpod.store.scan import events_of_jobs, job_facts
from trainpod.telemetry.exposition import render
from trainpod.telemetry.goodput import KINDS as GOODPUT_KINDS
from trainpod.telemetry.goodput import compute_goodput
from trainpod.telemetry.metrics import Scrape, families

from .healing import HealingCluster, Make

ADMIN = {"Authorization": "Bearer admin-secret"}
SCRAPE = {"Authorization": "Bearer scrape-secret"}


@pytest.fixture
def cluster(make: Make) -> HealingCluster:
    c = make()
    for agent in c.agents.values():
        agent.devices = DeviceTelemetry(
            SimulatedReader(2, None, clock=c.clock.now), clock=c.clock.now
        )
    c.up()
    return c


@pytest.fixture
def client(cluster: HealingCluster) -> Iterator[TestClient]:
    def info() -> ClusterInfo:
        raise AssertionError("not used")

    app = create_app(
        cluster.controller,
        admin_token="admin-secret",
        agent_token="agent-secret",
        info=info,
        scrape_token="scrape-secret",
    )
    with TestClient(app) as client:
        yield client


def scrape(client: TestClient) -> dict[str, list[Sample]]:
    r = client.get("/metrics", headers=SCRAPE)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(samples: dict[str, list[Sample]], name: str, **labels: str) -> float:
    found = [s.value for s in samples.get(name, []) if labels.items() <= s.labels.items()]
    assert len(found) == 1, f"{name}{labels}: {found} in {samples.get(name)}"
    return found[0]


def test_a_job_through_a_crash_shows_in_the_metrics(
    cluster: HealingCluster, client: TestClient
) -> None:
    c = cluster
    job = c.submit(auto_resume=True, team="vision")
    c.start(job)
    for step in range(1, 6):
        c.clock.advance(2.0)
        for r in c.job(job).attempts[-1].ranks:
            agent, attempt = c.agents[r.node], c.attempt_id(job)
            if r.rank == 0:
                agent.progress(attempt, 0, step, step_time_s=2.0, loss=2.5 - step / 10, tokens=1000)
            else:
                agent.progress(attempt, r.rank, step, step_time_s=2.0)
        c.tick(0.0)
    m = scrape(client)
    labels = {"job_id": str(job), "team": "vision"}
    assert value(m, "trainpod_job_step", **labels) == 5
    assert value(m, "trainpod_job_steps_per_second", **labels) == pytest.approx(0.5)
    assert value(m, "trainpod_job_loss", **labels) == pytest.approx(2.0)
    assert value(m, "trainpod_job_tokens_total", **labels) == 5000
    assert value(m, "trainpod_jobs", state="running", team="vision", partition="default") == 1
    assert value(m, "trainpod_nodes", state="allocated", group="workers") == 2
    assert value(m, "trainpod_node_state", node="workers-0", state="allocated") == 1
    assert value(m, "trainpod_attempts_total", team="vision") == 1
    util = value(m, "trainpod_device_utilization_ratio", node="workers-0", device="0")
    assert 0.8 < util <= 1.0
    assert {s.labels["simulated"] for s in m["trainpod_device_power_watts"]} == {"true"}
    assert value(m, "trainpod_job_energy_joules", **labels) > 0
    assert value(m, "trainpod_queue_wait_seconds_count", partition="default") == 1
    assert m["trainpod_scheduler_pass_seconds_count"][0].value >= 1

    c.crash(job, 3)
    c.tick(1.0)
    c.start(job)
    c.tick(1.0)
    m = scrape(client)
    assert value(m, "trainpod_restarts_total", team="vision") == 1
    assert value(m, "trainpod_faults_total", fault="crash") == 1
    assert value(m, "trainpod_fault_detection_seconds_count", fault="crash") == 1
    assert value(m, "trainpod_recovery_seconds_count", fault="crash") == 1
    assert value(m, "trainpod_recovery_seconds_sum", fault="crash") > 0
    lost = {s.labels["cause"] for s in m["trainpod_job_lost_seconds"] if s.value > 0}
    assert lost, m["trainpod_job_lost_seconds"]
    assert 0 < value(m, "trainpod_job_goodput_ratio", **labels) < 1
    assert 0 < value(m, "trainpod_team_goodput_ratio", team="vision") < 1

    c.finish(job)
    c.tick(120.0)  # long enough ago for its goodput to be kept
    m = scrape(client)
    assert "trainpod_job_goodput_ratio" not in m  # the job's own series ended with it
    assert value(m, "trainpod_jobs", state="completed", team="vision") == 1
    assert value(m, "trainpod_team_energy_joules_total", team="vision") > 0
    grams = value(m, "trainpod_team_co2e_grams_total", team="vision")
    joules = value(m, "trainpod_team_energy_joules_total", team="vision")
    assert grams == pytest.approx(joules / 3.6e6 * 475.0)  # the default: the world average
    assert value(m, "trainpod_cluster_energy_joules_total") > joules  # idle devices too
    assert 0 < value(m, "trainpod_cluster_goodput_ratio") < 1
    assert value(m, "trainpod_restarts_total", team="vision") == 1  # counted once


def test_the_fast_exposition_is_prometheus_clients_byte_for_byte(cluster: HealingCluster) -> None:
    c = cluster
    job = c.submit(auto_resume=True, team='the "quoted" team\\')  # label values escaped
    c.start(job)
    c.tick(3.0)
    c.crash(job, 1)
    c.tick(1.0)
    scrape = c.controller.metrics.scrape()
    assert render(families(scrape)) == generate_latest(_Fixed(families(scrape)))


class _Fixed(Collector):
    def __init__(self, fams: list[Metric]) -> None:
        self.fams = fams

    def collect(self) -> Iterable[Metric]:
        return self.fams


def test_who_may_scrape(cluster: HealingCluster, client: TestClient) -> None:
    admin = operator(cluster.cfg.operator)
    *_, bob = cluster.controller.access.add_user(admin, "bob", team=None, role="user", teams=set())
    assert client.get("/metrics", headers={"Authorization": f"Bearer {bob}"}).status_code == 200
    assert client.get("/metrics", headers=ADMIN).status_code == 200
    assert client.get("/metrics").status_code == 401
    r = client.get("/v1/jobs", headers=SCRAPE)
    assert r.status_code == 403 and "only /metrics" in r.json()["message"]
    agent = client.get("/metrics", headers={"Authorization": "Bearer agent-secret"})
    assert agent.status_code == 403


def test_the_controller_s_own_memory_is_served_by_holder(client: TestClient) -> None:
    """The process's resident memory and its native memory by holder (ADR 0045): what an
    operator reads off a controller that has run for months."""
    samples = scrape(client)
    assert value(samples, "process_resident_memory_bytes") > 10 * 2**20
    kinds = {s.labels["kind"]: s.value for s in samples["trainpod_process_malloc_bytes"]}
    assert set(kinds) == {"in_use", "free", "mmap"} and kinds["in_use"] > 0
    assert value(samples, "trainpod_process_sqlite_memory_bytes") > 0  # the store's pages


def test_a_long_history_is_worked_off_over_the_first_scrapes(cluster: HealingCluster) -> None:
    """A restarted controller's first scrapes fold the log, and compute the goodput of ended
    jobs no scrape kept yet, a bounded piece at a time; until done, the families that would
    read short are left out, and once done every family is the one a collector without
    bounds serves."""
    c = cluster
    for team in ("vision", "speech", "vision"):
        job = c.submit(auto_resume=True, team=team)
        c.start(job)
        c.tick(2.0)
        c.crash(job, 1)
        c.tick(1.0)
        c.start(job)
        c.tick(3.0)
        c.finish(job)
        c.tick(1.0)
    c.tick(120.0)  # long enough ago for their goodput to be kept
    ctl = c.controller

    def collector(**bounds: Any) -> ClusterMetrics:
        return _collector(ctl, **bounds)

    def names(scrape: Scrape) -> set[str]:
        return {m.name for m in families(scrape)}

    whole = collector().scrape()
    assert whole.goodput_behind == 0
    # A store from before ended jobs' goodput was kept (migration 11): nothing kept yet.
    with ctl._lock, ctl.store.transaction():
        ctl.store.connection.execute("DELETE FROM goodput_ended")
    bounded = collector(events_chunk=4, ended_chunk=1, catch_up_s=0.0)  # a chunk a scrape
    first = bounded.scrape()
    assert first.tally_behind and first.goodput_behind == 2
    assert "trainpod_faults" not in names(first) and "trainpod_faults" in names(whole)
    assert "trainpod_team_goodput_ratio" not in names(first)
    assert "trainpod_cluster_goodput_ratio" not in names(first)
    assert "trainpod_device_power_watts" in names(first)  # the rest is served as ever
    scrapes = [first]
    while scrapes[-1].tally_behind or scrapes[-1].goodput_behind:
        assert len(scrapes) < 100, "the backlog never shrinks"
        scrapes.append(bounded.scrape())
    assert scrapes[2].goodput_behind == 0  # one ended job a scrape
    done = scrapes[-1]
    assert names(done) == names(whole)
    assert done.teams == whole.teams and done.cluster_sums == whole.cluster_sums
    assert done.tally.faults == whole.tally.faults and done.tally.faults["crash"] == 3
    assert done.tally.restarts == whole.tally.restarts
    assert render(families(done)) == render(families(whole))
    # Once kept, a restarted controller computes none of it again: its first scrape has it.
    restarted = collector(events_chunk=4, ended_chunk=1, catch_up_s=0.0).scrape()
    assert restarted.goodput_behind == 0 and restarted.teams == whole.teams
    assert restarted.cluster_sums == whole.cluster_sums

    # Caught up: more than a chunk's worth later is neither hidden nor left short.
    for team in ("vision", "speech"):
        job = c.submit(auto_resume=True, team=team)
        c.start(job)
        c.tick(2.0)
        c.crash(job, 1)
        c.tick(1.0)
        c.start(job)
        c.finish(job)
    c.tick(120.0)
    after = bounded.scrape()
    assert not after.tally_behind and after.goodput_behind == 0  # both ended jobs counted
    assert "trainpod_faults" in names(after) and "trainpod_team_goodput_ratio" in names(after)
    assert after.teams == collector().scrape().teams
    assert after.tally.faults["crash"] == 5  # caught up: the rest folded at once


def test_bounds_below_one_are_refused(cluster: HealingCluster) -> None:
    ctl = cluster.controller
    with pytest.raises(ValueError, match="must be at least 1"):
        _collector(ctl, ended_chunk=0)


def test_goodput_from_the_scrapes_reads_is_the_api_s(cluster: HealingCluster) -> None:
    """/metrics computes goodput from job_facts and only the kinds of event goodput reads;
    the API from the whole JobInfo and every event: the same report, a live job's too."""
    c = cluster
    done = c.submit(auto_resume=True, team="vision")
    c.start(done)
    c.tick(2.0)
    c.crash(done, 1)
    c.tick(1.0)
    c.start(done)
    c.tick(3.0)
    c.finish(done)
    c.tick(1.0)
    live = c.submit(team="speech")
    c.start(live)
    c.tick(4.0)
    ctl, now = c.controller, c.clock.now()
    with ctl._lock:
        facts = job_facts(ctl.store, [done, live, 999])
        kinds = events_of_jobs(ctl.store, [done, live], GOODPUT_KINDS)
    assert [f.id for f in facts] == [done, live]  # unknown ids left out
    assert len(facts[0].attempts) == 2
    for f in facts:
        api = compute_goodput(ctl.job_info(f.id), ctl.event_infos(job_id=f.id), now)
        assert compute_goodput(f, kinds[f.id], now) == api


def test_a_job_submitted_after_the_scrape_read_the_jobs_counts_for_its_team(
    cluster: HealingCluster,
) -> None:
    ctl = cluster.controller
    metrics = _collector(ctl)
    job = cluster.submit(team="vision")
    cluster.start(job)
    metrics._fold(0.0)  # the log is folded after the heads are read: this job is new to it
    assert metrics.tally.attempts["vision"] == 1
    assert "unknown" not in metrics.tally.attempts


def test_an_ended_job_s_goodput_is_counted_while_the_store_cannot_keep_it(
    cluster: HealingCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk when a job's goodput would be kept: the sums have it all the same, once,
    and it is kept as soon as the store takes writes again."""
    c = cluster
    ctl = c.controller
    metrics = _collector(ctl)
    metrics.scrape()
    job = c.submit(auto_resume=True, team="vision")
    c.start(job)
    c.tick(3.0)
    c.finish(job)
    c.tick(120.0)

    def full(self: EndedGoodput, rows: Iterable[EndedGoodputRow]) -> list[int]:
        raise StoreUnavailable("database or disk is full")

    real = EndedGoodput.record
    monkeypatch.setattr(EndedGoodput, "record", full)
    during = metrics.scrape()
    assert during.goodput_behind == 0 and during.teams["vision"].wall_s > 0
    again = metrics.scrape()  # not counted twice while it waits
    assert again.teams == during.teams
    with ctl._lock:
        assert EndedGoodput(ctl.store).by_team() == {}
    monkeypatch.setattr(EndedGoodput, "record", real)
    after = metrics.scrape()
    assert after.teams == during.teams
    with ctl._lock:
        kept = EndedGoodput(ctl.store).by_team()
    assert kept["vision"].wall_s == during.teams["vision"].wall_s
    assert _collector(ctl).scrape().teams == during.teams  # a restart reads it back


def _collector(ctl: Controller, **bounds: Any) -> ClusterMetrics:
    """A fresh collector on ``ctl``'s store and books, as the controller builds its own."""
    return ClusterMetrics(
        ctl.store,
        ctl.cfg,
        ctl._lock,
        ctl.beacons,
        ctl.telemetry,
        ctl.planner,
        ctl.clock.now,
        **bounds,
    )
