"""The web dashboard (/ui) over a real controller and its real HTTP app: the login cookie
and what it may reach, the queue in scheduling order, a job's page, teams' quotas, nodes,
and a history of 10,000 jobs paged by id. The browser side is tests/browser/."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from markupsafe import escape

from trainpod.controller.access import Principal
from trainpod.controller.launch import rank_log_path
from trainpod.dashboard.auth import COOKIE
from trainpod.dashboard.routes import HISTORY_PAGE, WAITING_SHOWN
from trainpod.model.states import JobState
from trainpod.spec.job import JobSpec
from trainpod.spec.sharing import QuotaAmount, TeamSpec, UserSpec
from trainpod.testing import FakeClock, FakeGroup, make_config

from .conftest import ADMIN_TOKEN, Cluster, issue_tokens

ADMIN = {"Authorization": "Bearer admin-secret"}


@dataclasses.dataclass
class Dash:
    cluster: Cluster
    http: TestClient
    tokens: dict[str, str]

    def login(self, user: str) -> None:
        r = self.http.post("/ui/login", data={"token": self.tokens[user]})
        assert r.status_code == 303, r.text
        assert r.headers["location"] == "/ui/queue"

    def page(self, path: str) -> str:
        r = self.http.get(path)
        assert r.status_code == 200, (path, r.status_code, r.text[:500])
        return str(r.text)


@pytest.fixture
def dash(tmp_path: Path) -> Iterator[Dash]:
    cfg = dataclasses.replace(
        make_config(tmp_path, groups=(FakeGroup("workers", 3),)),
        teams=(
            TeamSpec(name="vision", quota={"default": QuotaAmount(nodes=1)}),
            TeamSpec(name="nlp", quota={"default": QuotaAmount(nodes=1)}, borrow_limit=1),
        ),
        team_quotas={"vision": {"default": 1}, "nlp": {"default": 1}},
        users=(UserSpec(name="alice", team="vision"), UserSpec(name="bob", team="nlp")),
        operator="root",
    )
    cluster = Cluster(cfg, tmp_path / "state.db", FakeClock())
    cluster.up()
    with TestClient(cluster.app(), follow_redirects=False) as http:
        tokens = {"admin": ADMIN_TOKEN, **issue_tokens(http, "alice", "bob")}
        yield Dash(cluster, http, tokens)
    cluster.close()


def who(d: Dash, name: str) -> Principal:
    p = d.cluster.controller.access.principal(d.tokens[name])
    assert p is not None
    return p


def submit(d: Dash, user: str, nodes: int = 1, **kw: object) -> int:
    spec = JobSpec(command=["python", "train.py"], nodes=nodes, procs_per_node=1, **kw)
    return d.cluster.controller.submit(spec, by=who(d, user))


# -- logging in -----------------------------------------------------------------------------
def test_pages_send_a_stranger_to_the_login_page_and_fragments_tell_htmx(dash: Dash) -> None:
    r = dash.http.get("/ui/queue")
    assert (r.status_code, r.headers["location"]) == (303, "/ui/login")
    r = dash.http.get("/ui/fragments/queue", headers={"HX-Request": "true"})
    assert (r.status_code, r.headers["hx-redirect"]) == (401, "/ui/login")
    login = dash.page("/ui/login")
    assert 'name="token"' in login and "trainpod users add" in login
    # Static files need no login (the login page uses them).
    r = dash.http.get("/ui/static/vendor/htmx-2.0.11/htmx.min.js")
    assert r.status_code == 200 and "htmx" in r.text[:2000]


@pytest.mark.parametrize("token", ["", "tp_not-a-token", "agent-secret"])
def test_a_wrong_token_is_refused_with_what_to_do(dash: Dash, token: str) -> None:
    r = dash.http.post("/ui/login", data={"token": token})
    assert r.status_code == 401
    assert COOKIE not in r.cookies
    assert 'id="login-error"' in r.text
    assert ("paste a token" if not token else "trainpod users add") in r.text


def test_the_login_cookie_is_httponly_samesite_strict_and_names_the_user(dash: Dash) -> None:
    r = dash.http.post("/ui/login", data={"token": dash.tokens["alice"]})
    assert r.status_code == 303
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie
    assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
    assert "alice (user, team vision)" in dash.page("/ui/queue")
    r = dash.http.post("/ui/logout")
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    assert dash.http.get("/ui/queue").status_code == 303  # logged out


def test_the_cookie_reads_the_json_api_but_never_changes_anything(dash: Dash) -> None:
    dash.login("alice")
    assert dash.http.get("/v1/jobs").status_code == 200  # what the pages' scripts read
    assert dash.http.get("/v1/whoami").json()["name"] == "alice"
    job = {"command": ["python", "x.py"], "nodes": 1, "procs_per_node": 1}
    assert dash.http.post("/v1/jobs", json=job).status_code == 401  # a cookie alone: no
    r = dash.http.post(
        "/v1/jobs", json=job, headers={"Authorization": f"Bearer {dash.tokens['alice']}"}
    )
    assert r.status_code == 201  # with the bearer token, as ever
    assert dash.http.post("/v1/agent/heartbeat", json={}).status_code == 401


# -- what the pages show --------------------------------------------------------------------
def rows(html: str, table: str) -> list[str]:
    body = html.split(f'<table id="{table}">', 1)[1].split("</table>", 1)[0]
    return re.findall(r'<tr data-job="(\d+)">', body)


def test_the_queue_lists_waiting_jobs_in_scheduling_order_with_reasons(dash: Dash) -> None:
    c = dash.cluster
    running = submit(dash, "alice", nodes=3)
    c.start(running)
    later = [submit(dash, "bob"), submit(dash, "alice", nodes=2)]
    c.controller.step()
    infos = {j: c.job(j) for j in later}
    assert all(i.queue_position is not None for i in infos.values())
    dash.login("bob")
    html = dash.page("/ui/queue")
    order = sorted(later, key=lambda j: infos[j].queue_position or 0)
    assert rows(html, "waiting") == [str(j) for j in order]
    assert rows(html, "running") == [str(running)]
    for j in later:
        assert str(escape(infos[j].reason.splitlines()[0])) in html  # why it waits
    # The live fragment is the same table, without the page around it.
    fragment = dash.page("/ui/fragments/queue")
    assert rows(fragment, "waiting") == [str(j) for j in order] and "<html" not in fragment


def test_a_job_page_shows_attempts_events_progress_and_goodput(dash: Dash) -> None:
    c = dash.cluster
    job_id = submit(dash, "alice", nodes=1)
    attempt = c.start(job_id)
    node = c.job(job_id).attempts[-1].nodes[0]
    agent = c.agents[node]
    for step in range(1, 6):
        c.clock.advance(1)
        agent.progress(attempt, 0, step)
        agent.beat()
    points = c.controller.progress_history(job_id)
    assert [p.step for p in points] == [1, 2, 3, 4, 5]
    dash.login("alice")
    html = dash.page(f"/ui/jobs/{job_id}")
    assert f"Job {job_id}" in html and '<tr data-attempt="1">' in html
    assert "job_submitted" in html and "attempt_created" in html  # the timeline
    chart = re.search(r"<canvas data-chart='([^']*)'", html)  # the goodput breakdown
    assert chart is not None and '"type": "doughnut"' in chart.group(1)
    assert '"productive"' in chart.group(1)
    assert "Step rate" in html and "steps / s" in html
    assert "step 5 (attempt 1)" in html
    assert 'id="log-poller"' in html  # the log follows
    log = dash.page(f"/ui/fragments/jobs/{job_id}/log?rank=0")
    assert 'id="log-poller"' in log  # no log yet (fake ranks write none): it polls on


def test_a_private_jobs_logs_say_why_they_are_not_shown(dash: Dash) -> None:
    job_id = submit(dash, "alice", private=True)
    dash.login("bob")
    html = dash.page(f"/ui/jobs/{job_id}")
    assert 'id="log-refused"' in html and "belongs to alice" in html
    assert 'id="log-poller"' not in html


def test_teams_show_quota_used_and_borrowed(dash: Dash) -> None:
    c = dash.cluster
    job_id = submit(dash, "bob", nodes=2)  # nlp: quota 1, borrows 1 of vision's idle one
    c.start(job_id)
    assert c.job(job_id).state == JobState.RUNNING, c.job(job_id).reason
    dash.login("alice")
    html = dash.page("/ui/teams")
    nlp = re.search(r'<tr data-team="nlp">(.*?)</tr>', html, re.S)
    assert nlp is not None
    cells = re.findall(r"<td[^>]*>(.*?)</td>", nlp.group(1), re.S)
    assert [x.strip() for x in cells[:5]] == ["nlp", "default", "1", "2", "1"]
    assert "yes (up to 1)" in nlp.group(1)


def test_nodes_show_state_devices_health_and_where_telemetry_comes_from(dash: Dash) -> None:
    c = dash.cluster
    c.agents["workers-1"].set_health("disk", "warn", reason="scratch 91% full")
    c.beat()
    dash.login("alice")
    html = dash.page("/ui/nodes")
    assert html.count('<tr data-node="') == 3
    assert 'title="scratch 91% full">disk' in html
    # The page's script reads the sparklines and the energy from the metrics work's routes
    # ("no telemetry" where there are none; tests/integration/test_dashboard_browser.py).
    assert 'data-telemetry="/v1/nodes/workers-0/telemetry" data-field="power_w"' in html
    assert 'data-energy-url="/v1/energy"' in html


def test_ten_thousand_jobs_in_the_history_are_paged_by_id(dash: Dash) -> None:
    store = dash.cluster.controller.store
    spec = JobSpec(command=["python", "x.py"], nodes=1, procs_per_node=1, user="alice")
    body = spec.model_dump(mode="json")
    with store.transaction():
        ids = [store.insert_job(f"old-{i}", body, float(i)) for i in range(10_000)]
        for i in ids:
            store.update_job(i, float(i), state=JobState.COMPLETED, ended_at=float(i) + 1)
    dash.login("alice")
    html = dash.page("/ui/queue")
    shown = rows(html, "history")
    assert shown == [str(i) for i in range(ids[-1], ids[-1] - HISTORY_PAGE, -1)]
    assert "completed 10000" in html
    older = re.search(r'id="older" href="/ui/queue\?before=(\d+)"', html)
    assert older is not None and int(older.group(1)) == ids[-1] - HISTORY_PAGE + 1
    deep = dash.page(f"/ui/queue?before={ids[10]}")  # the last page: ten jobs left
    assert rows(deep, "history") == [str(i) for i in range(ids[9], ids[0] - 1, -1)]
    assert 'id="older"' not in deep
    assert dash.page(f"/ui/jobs/{ids[0]}").count("old-0") >= 1


def test_a_long_queue_lists_its_first_jobs_and_counts_the_rest(dash: Dash) -> None:
    c = dash.cluster
    c.start(submit(dash, "alice", nodes=3))  # every node busy: the rest wait
    for _ in range(WAITING_SHOWN + 7):
        submit(dash, "bob")
    c.controller.step()
    dash.login("bob")
    html = dash.page("/ui/queue")
    assert len(rows(html, "waiting")) == WAITING_SHOWN
    assert "… and 7 more waiting behind these" in html


# -- hostile numbers ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/ui/jobs/99999999999999999999", "job_id"),  # past SQLite's INTEGER: was a 500
        ("/ui/queue?before=99999999999999999999", "before"),  # was a 500 too
        ("/ui/fragments/queue?before=-1", "before"),
        ("/ui/jobs/-1", "job_id"),
        ("/ui/jobs/{job}?rank=-3", "rank"),
        ("/ui/fragments/jobs/{job}/log?offset=-5", "offset"),  # a seek before the start: 500
        ("/ui/fragments/jobs/{job}/log?offset=99999999999999999999", "offset"),
        ("/ui/fragments/jobs/{job}/log?attempt=-1", "attempt"),
    ],
)
def test_numbers_out_of_range_are_refused_naming_the_parameter(
    dash: Dash, path: str, name: str
) -> None:
    """Found when the API's fuzz was let into the dashboard: its ids, offsets and ranks had
    no bounds, and some reached SQLite or a file's seek. Now they are refused (422) before a
    route runs, with the parameter named."""
    job = submit(dash, "alice")
    attempt = dash.cluster.start(job)
    log = rank_log_path(dash.cluster.cfg, job, 1, 0)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("step 1\n")  # a real log, so an offset would reach the file
    assert attempt
    dash.login("admin")
    r = dash.http.get(path.format(job=job))
    assert r.status_code == 422, (path, r.status_code, r.text[:300])
    assert [e["loc"][-1] for e in r.json()["detail"]] == [name]
    assert "step 1" in dash.page(f"/ui/fragments/jobs/{job}/log")  # in range, it reads
