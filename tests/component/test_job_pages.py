"""``GET /v1/jobs`` a page at a time (``after`` and ``limit``), and the client reading a
long list that way on a real HTTP server: the same jobs, in the same order, as one call,
however the pages fall."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from trainpod.client.http import TrainpodClient
from trainpod.testing import FakeGroup

from .conftest import Cluster, MakeCluster, serve

ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture
def served(make_cluster: MakeCluster) -> Iterator[tuple[Cluster, str]]:
    c = make_cluster(groups=(FakeGroup("workers", 1, devices=1),))
    c.up()
    with serve(c) as url:
        yield c, url


def _ids(url: str, **params: Any) -> list[int]:
    r = httpx.get(f"{url}/v1/jobs", params=params, headers=ADMIN)
    assert r.status_code == 200, r.text
    return [j["id"] for j in r.json()]


def test_a_page_is_the_first_jobs_after_the_cursor(served: tuple[Cluster, str]) -> None:
    c, url = served
    ids = [c.submit(nodes=1, procs=1) for _ in range(5)]
    c.controller.cancel(ids[1])
    assert _ids(url) == ids
    assert _ids(url, after=0, limit=2) == ids[:2]
    assert _ids(url, after=ids[1], limit=2) == ids[2:4]
    assert _ids(url, after=ids[3], limit=2) == ids[4:]
    assert _ids(url, after=ids[4], limit=2) == []
    assert _ids(url, after=ids[2]) == ids[3:]  # no limit: everything after
    assert _ids(url, limit=2) == ids[3:]  # no cursor: the newest, as before
    live = [i for i in ids if i != ids[1]]
    assert _ids(url, all=False, after=0, limit=2) == live[:2]  # the filter, then the page
    assert _ids(url, all=False, after=live[1], limit=2) == live[2:4]


@pytest.mark.parametrize("after", ["-1", str(2**63), "x"])
def test_a_bad_cursor_is_a_422_naming_it(served: tuple[Cluster, str], after: str) -> None:
    _, url = served
    r = httpx.get(f"{url}/v1/jobs", params={"after": after}, headers=ADMIN)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["query", "after"]


def test_the_client_reads_a_long_list_a_page_at_a_time(
    served: tuple[Cluster, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    c, url = served
    ids = [c.submit(nodes=1, procs=1) for _ in range(7)]
    c.controller.cancel(ids[0])
    client = TrainpodClient(url, "admin-secret")
    calls: list[dict[str, Any]] = []
    real = client._call

    def spy(method: str, path: str, reply: Any, **kw: Any) -> Any:
        calls.append(dict(kw.get("params") or {}))
        return real(method, path, reply, **kw)

    monkeypatch.setattr(client, "_call", spy)
    whole = client.jobs(page=None)
    assert [j.id for j in whole] == ids and len(calls) == 1
    for page, expected_calls in [(1, 8), (2, 4), (3, 3), (7, 2), (500, 1)]:
        calls.clear()
        assert client.jobs(page=page) == whole
        assert len(calls) == expected_calls, (page, calls)
        assert all(p["limit"] == page for p in calls)
    calls.clear()
    assert [j.id for j in client.jobs(include_ended=False, page=2)] == ids[1:]
    assert len(calls) == 4  # six live jobs: three full pages, then an empty one
    assert [j.id for j in client.jobs(limit=2)] == ids[-2:]  # a limit: the newest, one call
    with pytest.raises(ValueError, match="page must be at least 1, not 0"):
        client.jobs(page=0)
