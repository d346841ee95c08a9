"""The node leader's rendezvous stores (ADR 0028): real c10d TCPStores on real ports, opened
before a rank could connect, kept while the controller names the attempt, closed after."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch.distributed as dist

from trainpod.agent.rdzvstore import RendezvousStores, StoreError, tcp_store
from trainpod.controller.ports import free_port
from trainpod.testing.wait import wait_until

ADDR = "127.0.0.1"


class Ticks:
    """A clock that moves only when told (the ``asked_at`` of the agent's heartbeats)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((ADDR, port)) == 0


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore(ADDR, port, is_master=False, timeout=datetime.timedelta(seconds=10))


def test_a_store_serves_clients_from_open_until_its_attempt_is_gone() -> None:
    clock = Ticks()
    stores = RendezvousStores(clock=clock)
    port = free_port(ADDR)
    assert not listening(port)
    assert stores.open(7, ADDR, port)
    assert stores.open(7, ADDR, port)  # the launch order again: the same store
    rank0, rank1 = client(port), client(port)  # every rank is a client, rank 0 too
    rank0.set("k", "from rank 0")
    del rank0  # rank 0 has gone: the store has not
    assert rank1.get("k") == b"from rank 0"
    # A reply to a beat sent before the store was opened cannot know of the attempt.
    assert stores.keep([], asked_at=clock.t - 1) == []
    clock.t += 1
    assert stores.keep([7], asked_at=clock.t + 0.5) == []  # still named: kept
    assert listening(port)
    assert stores.keep([], asked_at=clock.t + 1) == [7]  # the attempt has ended
    assert not listening(port)
    assert stores.ports() == {}
    del rank1
    assert stores.open(8, ADDR, port)  # the port is free again: nothing leaked
    stores.close_all()


def test_generations_add_stores_that_close_with_their_attempt() -> None:
    clock = Ticks()
    stores = RendezvousStores(clock=clock)
    first, second, other = free_port(ADDR), free_port(ADDR), free_port(ADDR)
    assert stores.open(1, ADDR, first) and stores.open(2, ADDR, other)
    assert stores.hosts(1) and not stores.hosts(3)
    assert stores.open(1, ADDR, second)  # generation 1 of attempt 1 (ADR 0026)
    assert stores.ports() == {1: sorted([first, second]), 2: [other]}
    assert stores.keep([2], asked_at=clock.t + 1) == [1]  # attempt 1 killed: both close
    assert not listening(first) and not listening(second) and listening(other)
    stores.close_all()  # the agent leaves
    assert not listening(other) and stores.ports() == {}


def test_a_port_already_taken_is_an_error_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind((ADDR, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StoreError, match=f"port {port}"):
            tcp_store(ADDR, port)
        stores = RendezvousStores()
        assert not stores.open(4, ADDR, port)  # logged; the ranks' rendezvous fails
        assert stores.ports() == {4: []}


class Gated:
    """A real store that opens only once let (the first one imports torch: seconds)."""

    def __init__(self) -> None:
        self.go = threading.Event()

    def __call__(self, addr: str, port: int) -> object:
        assert self.go.wait(30), "never let open"
        return tcp_store(addr, port)


def test_a_store_opens_in_a_thread_and_beats_never_wait_for_it() -> None:
    gate, clock = Gated(), Ticks()
    stores = RendezvousStores(factory=gate, clock=clock)
    port = free_port(ADDR)
    stores.open_soon(3, ADDR, port)  # returns while torch would still be importing
    stores.open_soon(3, ADDR, port)  # the launch order again: the same opening
    assert stores.keep([3], asked_at=clock.t + 1) == []  # not blocked by the opening
    assert stores.hosts(3) and stores.ports() == {3: []}
    rank = threading.Thread(target=lambda: client(port).set("k", "v"))  # a rank came first:
    rank.start()  # its client retries the refused connection
    gate.go.set()
    wait_until(lambda: listening(port), timeout_s=30, what="the store to listen")
    rank.join(30)
    assert not rank.is_alive()
    assert client(port).get("k") == b"v"
    stores.open_soon(3, ADDR, port)  # open already: nothing happens
    assert stores.ports() == {3: [port]}
    stores.close_all()


def test_an_attempt_that_ends_while_its_store_opens_leaves_no_store() -> None:
    gate, clock = Gated(), Ticks()
    stores = RendezvousStores(factory=gate, clock=clock)
    port = free_port(ADDR)
    stores.open_soon(5, ADDR, port)
    assert stores.keep([], asked_at=clock.t + 1) == [5]  # cancelled meanwhile
    gate.go.set()
    wait_until(
        lambda: not any(t.name == "rdzv-store-5" for t in threading.enumerate()),
        timeout_s=30,
        what="the opener to finish",
    )
    assert stores.ports() == {}
    assert not listening(port)  # the store it made was dropped
