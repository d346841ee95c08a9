"""GET /v1/jobs serialises ended jobs once; what it sends equals the models, and a job
that changes is sent as it is now."""

from __future__ import annotations

import json

from trainpod.testing import FakeGroup

from .conftest import MakeCluster


def test_the_jobs_json_is_the_models_and_follows_changes(make_cluster: MakeCluster) -> None:
    c = make_cluster(groups=(FakeGroup("workers", 2, devices=1),))
    c.up()
    done = c.submit(nodes=1, procs=1)
    attempt = c.start(done)
    c.agents[c.job(done).attempts[0].nodes[0]].exit_all(attempt)
    c.beat()
    live = c.submit(nodes=2, procs=1)
    c.controller.step()

    def sent() -> list[dict[str, object]]:
        return list(json.loads(c.controller.jobs_json()))

    def models() -> list[dict[str, object]]:
        return [j.model_dump(mode="json") for j in c.controller.job_infos()]

    assert sent() == models()
    c.clock.advance(120)  # the ended job is now frozen
    assert sent() == models()
    assert [j["id"] for j in sent()] == [done, live]
    c.controller.cancel(live)
    assert sent() == models()  # the live job is rebuilt every time
    assert sent()[1]["state"] == "cancelled"
    c.clock.advance(120)
    assert sent() == models()  # both frozen now; still equal
    assert json.loads(c.controller.jobs_json(include_ended=False)) == []
    assert [j["id"] for j in json.loads(c.controller.jobs_json(limit=1))] == [live]


def test_changes_name_the_jobs_with_an_event_since_a_look(make_cluster: MakeCluster) -> None:
    c = make_cluster(groups=(FakeGroup("workers", 2, devices=1),))
    c.up()
    views = c.controller.views
    quiet = c.submit(nodes=1, procs=1)
    c.controller.cancel(quiet)  # ended: nothing happens to it any more
    newest, changed = views.changes(None)
    assert newest > 0 and changed == set()  # the first look: only where the log is
    assert views.changes(newest) == (newest, set())  # nothing since
    busy = c.submit(nodes=1, procs=1)
    c.start(busy)
    later, changed = views.changes(newest)
    assert later > newest and busy in changed and quiet not in changed


def test_a_spec_is_decoded_once_however_many_views(make_cluster: MakeCluster) -> None:
    c = make_cluster(groups=(FakeGroup("workers", 2, devices=1),))
    c.up()
    jobs = [c.submit(nodes=1, procs=1, team=f"t{i}") for i in range(3)]
    specs = c.controller.views.specs
    before = specs.decoded
    first = c.controller.job_infos()
    assert specs.decoded == before + 3
    decoded = specs.decoded
    again = c.controller.job_infos() + c.controller.views.of_jobs(jobs)
    c.controller.jobs_json()
    assert specs.decoded == decoded  # every later view shares them
    assert [j.spec.team for j in first] == ["t0", "t1", "t2"] == [j.spec.team for j in again[3:]]
