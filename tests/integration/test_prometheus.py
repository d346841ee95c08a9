"""A real Prometheus (Debian's package) scrapes a running local cluster's /metrics.

It uses the shipped scrape config and alert rules (deploy/prometheus/), pointed at the
test's cluster and its read-only scrape token. A job runs, one of its ranks is killed
(chaos kill-worker: a crash, then a restart) and a simulated GPU is made to throttle; then
the series are queried through Prometheus' HTTP API, and every expression of the Grafana
dashboards (deploy/grafana/) must parse and return data there. The GPUs are SIMULATED.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import Cluster
from tests.integration.prometheus import (
    DEPLOY,
    MISSING,
    PROMETHEUS,
    PROMTOOL,
    Prometheus,
    config_for,
)
from trainpod.api.models import ChaosRequest
from trainpod.testing.wait import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.skipif(PROMETHEUS is None, reason=MISSING)]
WORKERS = Path(__file__).parent / "workers"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
FRA_G_PER_KWH = 56.039  # codecarbon 3.3.2's table


def promtool(*args: str) -> str:
    assert PROMTOOL is not None, MISSING
    done = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_promtool_passes_the_shipped_rules_and_config() -> None:
    out = promtool("check", "rules", str(DEPLOY / "prometheus" / "trainpod-rules.yml"))
    assert "SUCCESS: 7 rules found" in out
    # The shipped token path is a placeholder: its content is checked with the cluster below.
    promtool("check", "config", "--syntax-only", str(DEPLOY / "prometheus" / "prometheus.yml"))


def dashboard_exprs() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expression) of every target of every shipped dashboard."""
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                out.append((path.name, panel["title"], target["expr"]))
    return out


def test_the_grafana_files_fit_together() -> None:
    provisioning = DEPLOY / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "trainpod.yml").read_text())[
        "datasources"
    ]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "trainpod.yml").read_text())[
        "providers"
    ]
    assert source["type"] == "prometheus" and provider["type"] == "file"
    assert len(DASHBOARDS) == 4
    uids = set()
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        uids.add(board["uid"])
        sources = {p["datasource"]["uid"] for p in board["panels"]}
        assert sources == {source["uid"]}, path.name
    assert len(uids) == 4
    assert len(dashboard_exprs()) >= 40


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[Cluster], Prometheus]]:
    started: list[Prometheus] = []

    def start(cluster: Cluster) -> Prometheus:
        target = f"{cluster.record.host}:{cluster.record.port}"
        p = Prometheus(tmp_path / "prometheus", config_for(target, cluster.paths.scrape_token))
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def running_attempt(cluster: Cluster, job_id: int, number: int) -> bool:
    job = cluster.client.job(job_id)
    live = job.attempts[-1] if job.attempts else None
    return bool(
        live is not None
        and live.number == number
        and live.state == "running"
        and job.progress
        and job.progress.get("last_step")
    )


def series(prom: Prometheus, expr: str, timeout_s: float = 30) -> list[dict[str, Any]]:
    """The result of ``expr`` once it has any (Prometheus scrapes every second)."""
    return wait_until(lambda: prom.query(expr), timeout_s=timeout_s, what=f"data for {expr}")


def value(result: list[dict[str, Any]]) -> float:
    (one,) = result
    return float(one["value"][1])


@pytest.mark.timeout(300)
def test_prometheus_scrapes_the_cluster_and_every_dashboard_query_has_data(
    make_cluster: Callable[..., Cluster], prometheus: Callable[[Cluster], Prometheus]
) -> None:
    c = make_cluster(extra="carbon:\n  country: FRA\n")
    job = c.submit(
        ["python", str(WORKERS / "metrics_train.py"), "--step-s", "0.1"],
        nodes=1,
        procs_per_node=2,
        auto_resume=True,
    )
    wait_until(lambda: running_attempt(c, job.id, 1), timeout_s=60, what="attempt 1 stepping")
    node = c.client.job(job.id).attempts[-1].nodes[0]
    c.client.chaos(ChaosRequest(node=node, fault="kill-worker", rank=1))
    wait_until(lambda: running_attempt(c, job.id, 2), timeout_s=90, what="attempt 2 stepping")
    c.client.chaos(ChaosRequest(node=node, fault="thermal"))

    prom = prometheus(c)
    promtool("check", "config", str(prom.config_file))  # the token file is real here
    wait_until(prom.targets_up, timeout_s=30, what="the controller's target up")
    cluster = f'cluster="{c.record.name}"'
    jid = f'job_id="{job.id}"'

    assert value(series(prom, f'trainpod_nodes{{{cluster},state="allocated"}} > 0')) == 1
    assert value(series(prom, f'sum(trainpod_jobs{{{cluster},state="running"}})')) == 1
    assert value(series(prom, "trainpod_restarts_total > 0")) == 1
    assert value(series(prom, 'trainpod_faults_total{fault="crash"} > 0')) == 1
    assert value(series(prom, 'trainpod_recovery_seconds_count{fault="crash"} > 0')) == 1
    assert value(series(prom, 'trainpod_fault_detection_seconds_count{fault="crash"}')) == 1
    assert 0 < value(series(prom, f"trainpod_job_goodput_ratio{{{jid}}}")) < 1
    assert value(series(prom, f"trainpod_job_steps_per_second{{{jid}}} > 1")) < 20
    assert 0 < value(series(prom, f"trainpod_job_loss{{{jid}}}")) < 10
    assert value(series(prom, f"rate(trainpod_job_tokens_total{{{jid}}}[10s]) > 0")) > 0
    busy = series(prom, 'trainpod_device_utilization_ratio{simulated="true"} > 0.5')
    assert {s["metric"]["node"] for s in busy} == {node}
    series(prom, f'trainpod_device_throttled{{node="{node}",reason="hw_thermal"}}')
    assert (
        value(series(prom, f'trainpod_device_temperature_celsius{{node="{node}",device="0"}}'))
        == 92
    )
    series(prom, "rate(trainpod_device_energy_joules_total[10s]) > 0")
    assert value(series(prom, f'trainpod_job_energy_joules{{{jid},simulated="true"}} > 0')) > 0
    assert value(series(prom, "trainpod_cluster_co2e_grams_total > 0")) > 0
    intensity = value(series(prom, "trainpod_carbon_intensity_grams_per_joule"))
    assert intensity * 3.6e6 == pytest.approx(FRA_G_PER_KWH)
    assert value(series(prom, "trainpod_scheduler_pass_seconds_count > 0")) >= 1

    def rules() -> list[dict[str, Any]]:
        return [r for g in prom.api("rules")["groups"] for r in g["rules"]]

    evaluated = wait_until(
        lambda: all(r["health"] == "ok" for r in rules()) and rules(),
        timeout_s=30,
        what="every alert rule evaluated without error",
    )
    assert len(evaluated) == 7, evaluated

    empty = []
    for board, title, expr in dashboard_exprs():
        query = expr.replace("$cluster", re.escape(c.record.name)).replace(
            "$__rate_interval", "15s"
        )
        try:
            wait_until(partial(prom.query, query), timeout_s=15, what=query)
        except AssertionError as exc:
            empty.append(f"{board} / {title}: {expr}: {exc}")
    assert not empty, "\n".join(empty)

    shown = c.cli("show", str(job.id)).stdout
    assert re.search(r"energy\s+\d+\.\d+ kWh, \d+\.\d+ kg CO2e \(SIMULATED devices\)", shown), shown
    assert "56.039 g/kWh" in shown and "France (FRA)" in shown
    c.client.cancel(job.id)
    c.wait_job(job.id)
