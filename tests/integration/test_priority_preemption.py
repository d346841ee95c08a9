"""The scheduler preempts on its own: a high-class job arrives while a low-class one holds
every node; the low job gets the notice, saves, waits as ``preempted`` and resumes from the
saved step once the high one is done (a real local cluster, real Gloo ranks)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_ckpt_cluster import remove_memory
from tests.integration.test_preemption import logged, steps
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
WORKER = str(Path(__file__).parent / "workers" / "preemptible.py")

CLASSES = """
priority_classes:
  - {name: high, value: 1000, preemptible: false}
  - {name: low, value: 10, default: true}
preemption:
  grace_s: 60
  min_run_s: 0  # preempted once it has steps; the minimum run: tests/component/test_sharing.py
"""


@pytest.mark.timeout(300)
def test_a_higher_class_preempts_the_running_job_which_resumes_from_its_notice_save(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(extra=CLASSES)
    low = c.submit(["python", WORKER, "--every", "5"], nodes=2, procs_per_node=1)
    assert low.spec.priority_class == "low"
    try:
        wait_until(
            lambda: min(len(steps(c, low.id, 1, r)) for r in (0, 1)) > 6,
            timeout_s=120,
            what=f"job {low.id} past step 5",
        )
        high = c.submit(
            ["python", "-c", "print('urgent work done')"],
            nodes=2,
            procs_per_node=1,
            priority_class="high",
        )
        # Low's nodes go to high once low has saved and stopped; then low runs again.
        assert c.wait_job(high.id, timeout_s=120).state == "completed"
        done = c.wait_job(low.id, timeout_s=150)
        assert done.state == "completed", done.reason
        [preempted] = [e for e in c.client.events(job_id=low.id) if e.kind == "job_preempted"]
        assert f"job {high.id}" in preempted.data["reason"], preempted.data
        first, second = done.attempts
        assert (first.cause, second.state) == ("preempted", "succeeded")
        saved = {int(logged(c, low.id, 1, r, "saved-on-notice")) for r in (0, 1)}
        (step,) = saved
        for rank in (0, 1):
            assert steps(c, low.id, 1, rank) == list(range(step + 1))
            assert steps(c, low.id, 2, rank)[0] == step + 1  # nothing lost beyond the save
        states = [e.data["new"] for e in c.client.events(job_id=low.id) if e.kind == "job_state"]
        assert "preempted" in states
        kinds = {e.kind for e in c.client.events(job_id=low.id)}
        assert not kinds & {"fault_detected", "recovery_decision"}
        high_log = c.client.logs(high.id, rank=0).data
        assert re.search("urgent work done", high_log)
    finally:
        remove_memory(c, low.id)
