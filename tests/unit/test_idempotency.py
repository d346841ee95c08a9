"""Idempotency keys in the store (ADR 0037): the same key and request give the first job,
another request is refused naming the key and what differs, keys are per caller and expire."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from trainpod.controller.idempotency import KEY_MAX, KEY_TTL_S, Replays, Request, parse_key
from trainpod.errors import IdempotencyKeyInvalid, IdempotencyKeyReused
from trainpod.spec.job import JobSpec
from trainpod.store.idempotency import IdempotencyKeys
from trainpod.store.repo import Store

T0 = 1_000_000.0
KEY = "8e03978e-40d5-43e8-bc93-6894a57f9324"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "state.db")
    yield s
    s.close()


def spec(**kw: object) -> Request:
    return Request.submit(JobSpec.model_validate({"command": ["python", "train.py"], **kw}))


def test_the_same_key_and_request_give_the_first_job(store: Store) -> None:
    replays = Replays(store)
    with store.transaction():
        assert replays.made("alice", KEY, spec(), T0) is None
        replays.remember("alice", KEY, spec(), 7, T0)
    with store.transaction():
        assert replays.made("alice", KEY, spec(), T0 + 60) == 7
        # the parsed request is compared: a default written out is the same request
        assert replays.made("alice", KEY, spec(nodes=1), T0 + 60) == 7


def test_another_request_with_the_key_names_the_key_and_what_differs(store: Store) -> None:
    replays = Replays(store)
    with store.transaction():
        replays.remember("alice", KEY, spec(nodes=2, env={"LR": "0.1"}), 7, T0)
    with store.transaction(), pytest.raises(IdempotencyKeyReused) as err:
        replays.made("alice", KEY, spec(nodes=3, env={"LR": "0.2"}), T0 + 90)
    message = str(err.value)
    assert KEY in message and "job 7" in message and "90 s ago" in message
    assert "nodes 2 then 3" in message and "env LR" in message
    assert "0.2" not in message  # env values are named, never shown


def test_a_secret_value_is_compared_but_never_kept_or_shown(store: Store) -> None:
    replays = Replays(store)
    with store.transaction():
        replays.remember("alice", KEY, spec(secret_env={"TOKEN": "hunter2"}), 7, T0)
    with store.transaction():
        assert replays.made("alice", KEY, spec(secret_env={"TOKEN": "hunter2"}), T0) == 7
    with store.transaction(), pytest.raises(IdempotencyKeyReused) as err:
        replays.made("alice", KEY, spec(secret_env={"TOKEN": "swordfish"}), T0)
    assert "secret_env differ (not shown)" in str(err.value)
    assert "swordfish" not in str(err.value) and "hunter2" not in str(err.value)
    dump = "\n".join(store.connection.iterdump())
    assert "hunter2" not in dump


def test_keys_are_each_callers_own(store: Store) -> None:
    replays = Replays(store)
    with store.transaction():
        replays.remember("alice", KEY, spec(), 7, T0)
        assert replays.made("bob", KEY, spec(), T0) is None
        assert replays.made("bob", KEY, spec(nodes=4), T0) is None  # nothing to differ from
        replays.remember("bob", KEY, spec(nodes=4), 8, T0)
    with store.transaction():
        assert replays.made("alice", KEY, spec(), T0) == 7
        assert replays.made("bob", KEY, spec(nodes=4), T0) == 8


def test_a_key_expires_and_is_pruned_by_a_later_call(store: Store) -> None:
    replays, keys = Replays(store), IdempotencyKeys(store)
    with store.transaction():
        replays.remember("alice", KEY, spec(), 7, T0)
    with store.transaction():
        assert replays.made("alice", KEY, spec(), T0 + KEY_TTL_S) == 7  # still kept
        later = T0 + KEY_TTL_S + 1
        assert replays.made("alice", KEY, spec(nodes=2), later) is None  # a new key again
        replays.remember("alice", "another", spec(), 9, later)
        assert keys.count() == 1  # the expired key went
        replays.remember("alice", KEY, spec(nodes=2), 10, later)
    with store.transaction():
        assert replays.made("alice", KEY, spec(nodes=2), later) == 10


@pytest.mark.parametrize(
    ("header", "key"),
    [(KEY, KEY), (f'"{KEY}"', KEY), (" abc ", "abc"), ("x" * KEY_MAX, "x" * KEY_MAX)],
)
def test_a_key_is_a_token_or_a_quoted_string(header: str, key: str) -> None:
    assert parse_key(header) == key


@pytest.mark.parametrize("header", ["", '""', "a b", 'a"b', "a\\b", "clé", "x" * (KEY_MAX + 1)])
def test_a_bad_key_is_refused_naming_the_limit(header: str) -> None:
    with pytest.raises(IdempotencyKeyInvalid) as err:
        parse_key(header)
    assert f"1 to {KEY_MAX} visible ASCII characters" in str(err.value)
    assert "Idempotency-Key" in str(err.value)
    assert len(str(err.value)) < 400  # a long key is not echoed whole
