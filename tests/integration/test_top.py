"""``trainpod top`` in a real pseudo-terminal against a real local cluster: it shows the
nodes and a running job, redraws in place when a job is submitted, and quits on q."""

from __future__ import annotations

import io
import os
import re
import sys

import pexpect
import pytest

from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration
TIMEOUT_S = 60  # pexpect's, per expect; never asserted on


def test_top_shows_nodes_and_jobs_and_redraws_when_a_job_is_submitted(cluster: Cluster) -> None:
    running = cluster.submit(
        ["python", "-c", "import time; time.sleep(120)"], name="top-sleeper", nodes=1
    )
    cluster.wait_job(running.id, {"running"})
    seen = io.StringIO()
    child = pexpect.spawn(
        sys.executable,
        ["-m", "trainpod.cli.main", "top", "--interval", "0.5"],
        cwd=str(cluster.workdir),
        env={**os.environ, "TRAINPOD_CLUSTER": cluster.paths.name, "TERM": "xterm-256color"},
        encoding="utf-8",
        codec_errors="replace",
        timeout=TIMEOUT_S,
        dimensions=(50, 200),
    )
    child.logfile_read = seen

    def expect(pattern: str) -> None:
        try:
            child.expect(pattern)
        except (pexpect.TIMEOUT, pexpect.EOF) as exc:
            shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.getvalue())[-4000:]
            raise AssertionError(
                f"{type(exc).__name__} waiting for {pattern!r}:\n{shown}"
            ) from None

    try:
        expect("trainpod top")
        expect("workers-0")
        expect("top-sleeper")
        # Both workers, one of them busy: it waits in the queue, with its reason.
        waiting = cluster.submit(["python", "-c", "pass"], name="top-waiting", nodes=2)
        expect("top-waiting")
        assert child.isalive()  # the same process redrew: nothing was restarted
        child.send("q")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, seen.getvalue()[-2000:]
    # It drew on the alternate screen and gave the terminal back on q.
    assert "\x1b[?1049h" in seen.getvalue() and "\x1b[?1049l" in seen.getvalue()
    cluster.client.cancel(waiting.id)
    cluster.client.cancel(running.id)


def test_top_once_prints_one_screen(cluster: Cluster) -> None:
    out = cluster.cli("top", "--once").stdout
    assert "NODES" in out and "workers-0" in out and "spares-0" in out
    assert "QUEUE" in out and "JOBS" in out
