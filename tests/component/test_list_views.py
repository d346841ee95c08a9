"""GET /v1/jobs serialises ended jobs once; what it sends equals the models, and a job
that changes is sent as it is now."""

from __future__ import annotations

import json

import pytest

from trainpod.controller import views
from trainpod.controller.views import SPEC_BYTES_BASE, SPEC_BYTES_PER_CHAR
from trainpod.store.rows import JobRow
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


def test_the_view_caches_stay_within_their_bytes_and_views_stay_right(
    make_cluster: MakeCluster,
) -> None:
    """With room for a few jobs in each cache, twelve ended jobs: the caches keep the newest
    that fit, never more than their bound, and every view is still the models."""
    bound = 5_000  # a job's JSON here is ~1 KB (four fit), its decoded spec ~4 KB (one)
    assert bound > SPEC_BYTES_BASE + SPEC_BYTES_PER_CHAR * 600  # one 0.6 KB spec fits
    c = make_cluster(groups=(FakeGroup("workers", 2, devices=1),), view_cache_bytes=bound)
    c.up()
    jobs = [c.submit(nodes=1, procs=1, team=f"t{i}") for i in range(12)]
    for job in jobs:
        c.controller.cancel(job)
    c.clock.advance(120)  # all frozen
    views = c.controller.views
    sent = json.loads(c.controller.jobs_json())
    assert sent == [j.model_dump(mode="json") for j in c.controller.job_infos()]
    assert [j["spec"]["team"] for j in sent] == [f"t{i}" for i in range(12)]
    for cache in (views.specs.cache, views.frozen):
        assert 0 < len(cache) < 12 and cache.bytes <= bound and cache.evicted > 0
        assert jobs[-1] in cache and jobs[0] not in cache  # the newest are kept
    assert json.loads(c.controller.jobs_json()) == sent  # rebuilt where evicted, the same
    assert views.frozen.bytes <= bound and views.specs.cache.bytes <= bound


def test_a_history_larger_than_the_cache_is_rebuilt_a_chunk_at_a_time(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ended jobs the cache does not hold are read and serialised REBUILD_CHUNK at a time
    (here 2): the listing is still every job as its model, in order, live ones included."""
    monkeypatch.setattr(views, "REBUILD_CHUNK", 2)
    c = make_cluster(groups=(FakeGroup("workers", 2, devices=1),), view_cache_bytes=0)
    c.up()
    ended = [c.submit(nodes=1, procs=1, team=f"t{i}") for i in range(7)]
    for job in ended:
        c.controller.cancel(job)
    live = c.submit(nodes=1, procs=1, team="live")
    c.clock.advance(120)
    reads: list[int] = []
    jobs_by_id = c.controller.store.jobs_by_id

    def counted(ids: list[int]) -> list[JobRow]:
        reads.append(len(ids))
        return jobs_by_id(ids)

    monkeypatch.setattr(c.controller.store, "jobs_by_id", counted)
    sent = json.loads(c.controller.jobs_json())
    assert reads == [3, 2, 2, 1]  # the live job with the first chunk, then the rest
    monkeypatch.undo()
    assert sent == [j.model_dump(mode="json") for j in c.controller.job_infos()]
    assert [j["id"] for j in sent] == [*ended, live]
