"""The controller ``kill -9``'d at random instants under load, with ``kill-worker`` faults
injected into running jobs meanwhile (a CI-size run; the longer one is
``benchmarks/reliability_kills.py``): the client's ledger matches the store afterwards."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.integration.conftest import Cluster
from trainpod.backends.procs import read_pid
from trainpod.cli.jobs import default_env
from trainpod.testing.killload import KillLoad, audit

pytestmark = pytest.mark.integration

SPEC = """\
name: {name}
backend: local
instance_groups:
  - name: workers
    count: 3
    devices_per_node: 1
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 30
"""


@pytest.mark.timeout(240)
def test_controller_kill_9_under_load(make_cluster_from_spec: Callable[[str], Cluster]) -> None:
    cluster = make_cluster_from_spec(SPEC)
    load = KillLoad(
        lambda: read_pid(cluster.paths.pid_file("controller")),
        cluster.backend.start,
        cluster.client,
        cluster.workdir,
        default_env(),
        queued=100,
        long_jobs=1,
        seed=14,
        fault_every_s=2.0,
    )
    load.start()
    load.run_kills(5, min_gap_s=1.0, max_gap_s=3.0)
    load.finish()
    result = audit(load)
    print(result.summary())
    assert result.kills == 5
    assert result.accepted > 1 + 100  # the long job, the queue filled, then refilled
    assert result.queued is not None and result.queued.max >= 30  # the queue did wait
    assert result.ok, result  # faulted jobs included: each ended completed
