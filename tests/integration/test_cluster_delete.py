"""`cluster delete` stops everything the cluster started, whatever it was doing.

Found by hand: a delete about 1 s after an XID 79 left the replacement agent and its zygote
running (the controller started them while it was being stopped), and one a few seconds
later left the node repair's deep check and its two device workers running until their own
timeout. Neither reproduces on today's code at any delay tried (0.5 to 6 s after the fault,
and during the deep check), but the delete no longer depends on how the daemons stop: every
process a local cluster starts carries its state dir in
``TRAINPOD_STATE_DIR`` (:data:`trainpod.backends.procs.MARKER_ENV`), so the test can look
for survivors the same way the delete does, and by command line too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import Cluster
from trainpod.api.models import ChaosRequest
from trainpod.backends.procs import leftovers
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
TRAIN = Path(__file__).parent / "workers" / "beacon_train.py"

SPEC = """\
name: {name}
backend: local
instance_groups:
  - name: workers
    count: 2
    devices_per_node: 2
  - name: spares
    count: 1
    devices_per_node: 2
    spare: true
health:
  check_interval_s: 0.5
"""


def survivors(state_dir: str) -> list[str]:
    """Every live process of the cluster: by its environment, or its command line."""
    found = {p.pid: p for p in leftovers(state_dir)}
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(state_dir in a for a in cmd):
            found[proc.pid] = proc
    out = []
    for pid, proc in sorted(found.items()):
        try:
            out.append(f"{pid} {' '.join(proc.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.mark.parametrize("when", ["as the fault lands", "while the node is repaired"])
@pytest.mark.timeout(150)
def test_delete_during_a_node_repair_leaves_no_process_behind(
    make_cluster_from_spec: Callable[[str], Cluster], when: str
) -> None:
    c = make_cluster_from_spec(SPEC)
    state_dir = str(c.paths.state_dir)
    argv = ["python", str(TRAIN), "--steps", "400", "--ckpt-every", "10", "--step-s", "0.05"]
    job = c.submit(argv, nodes=2, auto_resume=True)
    wait_until(
        lambda: c.client.job(job.id).state == "running",
        timeout_s=60,
        what=f"job {job.id} to run",
    )
    c.client.chaos(ChaosRequest(node="workers-1", fault="xid79"))
    if when == "while the node is repaired":
        wait_until(
            lambda: any(e.kind == "deep_check_started" for e in c.client.events(node="workers-1")),
            timeout_s=60,
            what="the repair's deep check to start on workers-1",
        )
    before = survivors(state_dir)
    assert before, "the cluster's processes are not found by their marker"
    assert c.paths.runtime_dir.is_dir()  # the agents' sockets

    c.cli("cluster", "delete", c.paths.name, "--purge")

    left = survivors(state_dir)
    assert not left, "\n".join(["still running after the delete:", *left])
    # Nor its sockets' dir (/tmp/trainpod-<hash>/): ~1,800 were left on one box.
    assert not c.paths.runtime_dir.exists(), sorted(c.paths.runtime_dir.iterdir())
