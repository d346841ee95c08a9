"""A soak at CI size (issue 14 item 6; an hour: ``benchmarks/reliability.py --part soak``): a
stream of short jobs, small GPT training jobs that checkpoint through trainpod.Checkpointer's
memory tier, and a fault every 20 s, for two minutes on a real local cluster. Every job ends
as its ledger says, and the cluster at rest afterwards holds nothing it did not hold before:
no memory tier in /dev/shm, no process under the agents, the controller's descriptors and
threads where they were. Growth per hour is printed, not asserted: two minutes on a shared
box cannot tell a slow leak from noise; the hour-long run reports it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from trainpod.backends.procs import read_pid
from trainpod.cli.jobs import default_env
from trainpod.testing.soak import SPEC, Sampler, Soak, gpt_argv

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_a_soak_ends_every_job_as_its_ledger_says_and_leaves_nothing_behind(
    make_cluster_from_spec: Callable[[str], Cluster],
) -> None:
    cluster = make_cluster_from_spec(
        SPEC.replace("{workers}", "3").replace("{view_cache_mib}", "1")
    )
    nodes = [n.name for n in cluster.client.nodes()]
    soak = Soak(
        cluster.client,
        Sampler(
            cluster.paths,
            nodes,
            lambda proc: read_pid(cluster.paths.pid_file(proc)),
            metrics=cluster.client.metrics,
        ),
        cluster.workdir,
        default_env(),
        train_argv=gpt_argv(sys.executable, REPO / "examples"),
        fault_every_s=20,
        sample_every_s=5,
        list_every_s=15,
        seed=14,
    )
    result = soak.run(minutes=2)
    print(result.report())
    assert result.mismatches() == []
    assert len(result.ledger.faults) >= 2, result.ledger.faults  # 5 in each run here
    kinds = set(result.ledger.kind.values())
    assert kinds == {"train", "short", "cancelled"}, kinds
    assert {f for _, _, f, _ in result.ledger.faults} == {"kill-worker", "xid79"}
    assert result.leaks_at_rest() == []
    assert len(result.samples) > 10
    native = result.final.native  # the controller's heaps and SQLite, from its /metrics
    assert native.malloc_in_use > 0 and native.sqlite > 0, native
    assert soak.listed > 0  # the whole list was read, through caches of 1 MiB
