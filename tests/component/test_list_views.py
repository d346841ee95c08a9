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
