"""A connection dropped before any answer, for real (a proxy closes it once the controller has
answered): a read is sent once more and answered; a write is not resent (only a submission,
which carries an idempotency key, is retried: test_idempotent_submit.py). This is what a
pooled keep-alive connection that the server closed as the client reused it looks like."""

from __future__ import annotations

import pytest

from tests.integration.conftest import Cluster
from tests.integration.lossyproxy import LossyProxy
from trainpod.api.models import NodeAction
from trainpod.client.http import KEEPALIVE_S, TrainpodClient
from trainpod.controller.daemon import KEEP_ALIVE_S
from trainpod.errors import ControllerUnavailable
from trainpod.paths import read_secret

pytestmark = pytest.mark.integration


def test_a_read_whose_connection_dropped_is_sent_once_more(cluster: Cluster) -> None:
    token = read_secret(cluster.paths.admin_token)
    with (
        LossyProxy(cluster.record.url, match=b"GET /v1/nodes ", drops=1) as proxy,
        TrainpodClient(proxy.url, token, retry_s=0) as client,
    ):
        nodes = client.nodes()
    assert sorted(n.name for n in nodes) == sorted(n.name for n in cluster.client.nodes())
    assert len(proxy.lost) == 1 and proxy.lost[0].startswith(b"HTTP/1.1 200")
    assert len(proxy.requests) == 2  # the first, dropped; the second, answered


def test_a_read_dropped_twice_says_the_controller_cannot_be_reached(cluster: Cluster) -> None:
    token = read_secret(cluster.paths.admin_token)
    with (
        LossyProxy(cluster.record.url, match=b"GET /v1/nodes ", drops=2) as proxy,
        TrainpodClient(proxy.url, token, retry_s=0) as client,
        pytest.raises(ControllerUnavailable, match="cannot reach the controller"),
    ):
        client.nodes()
    assert len(proxy.requests) == 2


def test_a_write_whose_connection_dropped_is_not_sent_again(cluster: Cluster) -> None:
    token = read_secret(cluster.paths.admin_token)
    node = cluster.client.nodes()[0].name
    with (
        LossyProxy(cluster.record.url, match=b"POST /v1/nodes/", drops=1) as proxy,
        TrainpodClient(proxy.url, token, retry_s=0) as client,
        pytest.raises(ControllerUnavailable, match="cannot reach the controller"),
    ):
        client.node_action(node, NodeAction(action="drain", reason="dropped-connection test"))
    assert len(proxy.requests) == 1  # nothing resent it
    assert len(proxy.lost) == 1 and proxy.lost[0].startswith(b"HTTP/1.1 200")
    # The controller did it, once: its answer was what the drop lost.
    drained = [
        e
        for e in cluster.client.events(node=node)
        if e.kind == "node_drain" and e.data["reason"] == "dropped-connection test"
    ]
    assert len(drained) == 1, drained
    assert (
        "dropped-connection test"
        in next(n for n in cluster.client.nodes() if n.name == node).reason
    )


def test_the_client_lets_an_idle_connection_go_before_the_controller_closes_it() -> None:
    assert KEEPALIVE_S < KEEP_ALIVE_S
