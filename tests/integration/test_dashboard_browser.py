"""The web dashboard in a real headless Chromium (Debian's, driven by Playwright) against a
real local cluster: a user logs in with their token, finds their job in the queue, follows
it through an injected fault (kill-worker) and sees the restart appear without reloading:
the new attempt, the fault in the timeline, the log moving on to attempt 2. Screenshots of
each page are kept as artifacts (the path is printed); with TRAINPOD_UPDATE_SCREENSHOTS=1
they are also copied to docs/screenshots/ for the README.

Skipped, saying why, where Playwright's package or /usr/bin/chromium is missing
(``scripts/services browser`` installs both).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Cluster
from trainpod.api.models import ChaosRequest, NewToken
from trainpod.cli.jobs import default_env
from trainpod.client.http import TrainpodClient
from trainpod.spec.job import JobSpec
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (scripts/services browser)"
)
CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TRAIN = Path(__file__).parent / "workers" / "dash_train.py"
DOCS = Path(__file__).parents[2] / "docs" / "screenshots"
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
teams:
  - name: vision
    quota: {{default: 1}}
  - name: nlp
    quota: {{default: 1}}
users:
  - {{name: alice, team: vision}}
  - {{name: bob, team: nlp}}
health:
  heartbeat_interval_s: 0.5
  heartbeat_timeout_s: 5
recovery:
  teardown_grace_s: 2
"""
WAIT_S = 60  # per wait; a deadline, never asserted on


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    root = Path(os.environ.get("TRAINPOD_ARTIFACTS") or tmp_path) / "dashboard"
    root.mkdir(parents=True, exist_ok=True)
    print(f"dashboard screenshots: {root}")
    return root


@pytest.fixture
def page(artifacts: Path) -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: `apt-get install chromium` (scripts/services browser)")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        page.set_default_timeout(WAIT_S * 1000)
        try:
            yield page
        finally:
            with contextlib.suppress(sync_api.Error):  # the page may be what broke
                page.screenshot(path=str(artifacts / "last.png"), full_page=True)
            context.close()
            browser.close()


def shot(page: Any, artifacts: Path, name: str) -> None:
    path = artifacts / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    if os.environ.get("TRAINPOD_UPDATE_SCREENSHOTS") == "1":
        DOCS.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, DOCS / path.name)


def text_of(page: Any, selector: str) -> str:
    loc = page.locator(selector)
    return str(loc.inner_text()) if loc.count() else ""


def wait_text(page: Any, selector: str, want: str) -> None:
    wait_until(
        lambda: want in text_of(page, selector),
        timeout_s=WAIT_S,
        what=f"{want!r} in {selector}",
    )


@pytest.mark.timeout(300)
def test_a_user_follows_a_job_through_a_fault_in_a_real_browser(
    make_cluster_from_spec: Callable[[str], Cluster], page: Any, artifacts: Path
) -> None:
    c = make_cluster_from_spec(SPEC)
    alice = c.client.add_user(NewToken(name="alice")).token
    bob = c.client.add_user(NewToken(name="bob")).token
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    page.on(
        "console",
        lambda m: (
            errors.append(f"console: {m.text} at {m.location.get('url')}")
            if m.type == "error" and not _optional_route(str(m.location.get("url")))
            else None
        ),
    )
    loads: list[str] = []
    page.on("load", lambda p: loads.append(p.url))

    with TrainpodClient(c.record.url, alice) as as_alice:
        argv = ["python", str(TRAIN), "--steps", "150", "--every", "10", "--step-s", "0.15"]
        spec = JobSpec(
            command=argv,
            name="dash-demo",
            nodes=1,
            procs_per_node=1,
            auto_resume=True,
            env=default_env(),
            workdir=str(c.workdir),
        )
        job = as_alice.submit(spec)
    c.wait_job(job.id, {"running"})
    with TrainpodClient(c.record.url, bob) as as_bob:
        spec = JobSpec(
            command=["python", "-c", "import time; time.sleep(3)"],
            name="needs-both-workers",
            nodes=2,
            procs_per_node=1,
            env=default_env(),
            workdir=str(c.workdir),
        )
        waiting = as_bob.submit(spec)

    # A stranger goes to the login page; alice pastes her token.
    page.goto(f"{c.record.url}/ui/queue")
    assert page.url.endswith("/ui/login")
    shot(page, artifacts, "login")
    page.fill("#token", alice)
    page.click("#login")
    wait_text(page, "#whoami", "alice (user, team vision)")

    # The queue: her job runs, bob's waits with its place and reason.
    def queue_shows_both() -> bool:
        mine = page.locator(f'#running tr[data-job="{job.id}"]').count() == 1
        theirs = text_of(page, f'#waiting tr[data-job="{waiting.id}"]').split()
        return mine and theirs[:1] == ["1"]  # first in scheduling order

    wait_until(
        queue_shows_both,
        timeout_s=WAIT_S,
        what="alice's job running and bob's waiting first in line on the queue page",
    )
    assert "waiting for" in text_of(page, f'#waiting tr[data-job="{waiting.id}"]')
    shot(page, artifacts, "queue")

    # Her job's page: progress, curves from the beacons, the log following.
    page.click(f'#running tr[data-job="{job.id}"] a')
    page.wait_for_url(f"**/ui/jobs/{job.id}")
    page.evaluate("() => { window.__notReloaded = true; }")
    loaded = len(loads)
    wait_until(
        lambda: _last_step(text_of(page, "#job-live")) >= 15,
        timeout_s=WAIT_S,
        what="the job page to show step 15 or later (past a checkpoint)",
    )
    wait_text(page, "#log-text", "attempt=1 step=")
    wait_text(page, "#checkpoints", "memory")

    node = c.client.job(job.id).attempts[-1].nodes[0]
    c.client.chaos(ChaosRequest(node=node, fault="kill-worker", rank=0))

    # Without a reload: attempt 2 appears, the restart is counted, the log moves on.
    wait_until(
        lambda: page.locator('#attempts tr[data-attempt="2"]').count() == 1,
        timeout_s=WAIT_S,
        what="attempt 2 on the job page",
    )
    wait_text(page, "#job-restarts", "1")
    wait_text(page, "#events", "fault_detected")
    wait_text(page, "#events", "recovery_decision")
    assert "crash" in text_of(page, '#attempts tr[data-attempt="1"]')
    wait_text(page, "#log-text", "--- attempt 2 ---")
    wait_text(page, "#log-text", "attempt=2 start=")
    wait_until(
        lambda: (
            _last_step(text_of(page, "#job-live")) >= 25
            and "(attempt 2)" in text_of(page, "#job-live")
        ),
        timeout_s=WAIT_S,
        what="attempt 2 making progress on the page",
    )
    assert page.evaluate("() => window.__notReloaded === true")
    assert len(loads) == loaded, loads  # no navigation: htmx swapped the fragments
    wait_until(  # goodput, loss, step rate: drawn by Chart.js (between two swaps)
        lambda: (
            page.evaluate(
                "() => [...document.querySelectorAll('canvas[data-chart]')]"
                ".filter((c) => Chart.getChart(c)).length"
            )
            == 3
        ),
        timeout_s=WAIT_S,
        what="the job page's three charts drawn",
    )
    wait_text(page, "#job-energy", "kWh")
    shot(page, artifacts, "job")

    page.click("text=Nodes")
    wait_until(
        lambda: page.locator("#node-table tr[data-node]").count() == 3,
        timeout_s=WAIT_S,
        what="three nodes on the nodes page",
    )
    # the node's telemetry (simulated devices here) drawn as sparklines; the cluster's energy
    row = '#node-table tr[data-node="workers-0"]'
    wait_until(
        lambda: page.locator(f"{row} canvas.sparkline").count() == 2,
        timeout_s=WAIT_S,
        what="utilisation and power sparklines of workers-0",
    )
    wait_text(page, "#cluster-energy", "kWh")
    shot(page, artifacts, "nodes")

    page.click("text=Teams")
    wait_text(page, "#team-table", "vision")
    shot(page, artifacts, "teams")
    assert errors == [], errors


def _optional_route(url: str) -> bool:
    """The routes the pages try and do without (a 404 there is not an error)."""
    return url.endswith("/telemetry") or url.endswith("/energy")


def _last_step(live: str) -> int:
    """The step in the progress tile ("step 17 (attempt 1) ..."); -1 if none yet."""
    words = live.split()
    for i, w in enumerate(words[:-1]):
        if w == "step" and words[i + 1].isdigit():
            return int(words[i + 1])
    return -1
