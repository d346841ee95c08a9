"""Heartbeat replies encoded once per orders' hash: the same JSON as the stamped orders'."""

from __future__ import annotations

import json

from trainpod.api.heartbeat import ReplyCache
from trainpod.api.models import KillOrder, Orders


def test_a_kept_reply_is_the_stamped_orders_with_each_calls_time() -> None:
    cache = ReplyCache()
    idle = Orders(active_jobs=[]).sealed()
    busy = Orders(kill=[KillOrder(attempt_id=3, grace_s=1.5, reason="x")]).sealed()
    assert idle.hash and busy.hash and idle.hash != busy.hash
    for orders in (idle, busy, idle, busy):
        for now in (1.25, 1764612345.123456):
            body = cache.encode(orders, now)
            stamped = orders.model_copy(update={"controller_time": now})
            assert json.loads(body) == json.loads(stamped.model_dump_json())
            assert Orders.model_validate_json(body) == stamped


def test_unsealed_orders_are_encoded_each_time_and_a_full_cache_keeps_the_newest() -> None:
    one = len(Orders(active_jobs=[0]).sealed().model_dump_json()) + 128
    cache = ReplyCache(max_bytes=one)
    loose = Orders(heartbeat_interval_s=2.0)  # no hash: never kept
    assert json.loads(cache.encode(loose, 5.0))["heartbeat_interval_s"] == 2.0
    many = [Orders(active_jobs=[i]).sealed() for i in range(3)]
    for orders in many + many:
        decoded = Orders.model_validate_json(cache.encode(orders, 7.0))
        assert decoded.active_jobs == orders.active_jobs
        assert len(cache) == 1  # room for one: the newest


def test_sealed_orders_are_kept_and_shared() -> None:
    a = Orders(active_jobs=[1]).sealed()
    b = Orders(active_jobs=[1]).sealed()
    assert a is b and a.hash
    assert Orders(active_jobs=[2]).sealed().hash != a.hash
