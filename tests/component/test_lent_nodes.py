"""Backfill past a reservation (ADR 0050) as the controller applies it: a real controller
and store, fake agents, a fake clock. A preemptible job whose ``--time`` reaches past the
waiting job's expected start starts on the nodes that job reserved; the store keeps who
lent them (a restarted controller still knows); once the waiting job can start it preempts
the borrower with the notice, and the borrower waits as ``preempted``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trainpod.cli.jobs import print_job
from trainpod.cli.render import console
from trainpod.controller.config import PreemptionConfig
from trainpod.model.states import AttemptState
from trainpod.testing import FakeClock, FakeGroup, make_config

from .conftest import Cluster


def lending_cluster(tmp_path: Path, lend: bool = True) -> Cluster:
    cfg = dataclasses.replace(
        make_config(tmp_path, groups=(FakeGroup("workers", 4),)),
        preemption=PreemptionConfig(grace_s=5.0, min_run_s=0.0, lend_reserved=lend),
    )
    c = Cluster(cfg, tmp_path / "state.db", FakeClock())
    c.up()
    return c


def test_a_borrower_runs_on_reserved_nodes_until_their_owner_can_start(tmp_path: Path) -> None:
    c = lending_cluster(tmp_path)
    first = c.submit(nodes=2, procs=1, time_limit="2")  # declares 2 min
    first_attempt = c.start(first)
    head = c.submit(nodes=4, procs=1, time_limit="2")
    borrower = c.submit(nodes=2, procs=1, time_limit="10")  # would end long after the head's start
    c.start(borrower)
    info = c.job(borrower)
    assert info.state == "running"
    assert c.controller.store.attempts(borrower)[-1].lent_by == (head,)
    (created,) = [e for e in c.events("attempt_created") if e.job_id == borrower]
    assert created.data["lent_by"] == [head]
    assert c.job(head).state == "queued"
    assert c.job(head).estimated_start is not None
    assert info.attempts[-1].lent_by == [head]  # the API says so, and `trainpod show`:
    with console.capture() as shown:
        print_job(info)
    assert f"on nodes reserved by job {head}: preempted, with notice, when it can start" in (
        shown.get()
    )

    c.clock.advance(2)
    c.restart_controller()  # who lent the nodes is in the store, not only in memory
    c.beat()
    c.clock.advance(28)
    for name in c.job(first).attempts[-1].nodes:  # ends 90 s before its limit
        c.agents[name].exit_all(first_attempt)
    c.beat()
    c.controller.step()

    (preempted,) = c.events("job_preempted")
    assert preempted.job_id == borrower
    assert preempted.data["reason"] == (
        f"job {head} needs the nodes it had reserved, lent to this job meanwhile"
    )
    for name in c.job(borrower).attempts[-1].nodes:
        orders = c.agents[name].beat()
        [kill] = orders.kill
        assert (kill.notice_signal, kill.notice_grace_s) == ("SIGUSR1", 5.0)
        c.agents[name].kill_ranks(orders)
        c.agents[name].beat()
    c.controller.step()
    assert c.job(borrower).state == "preempted"
    assert not c.events("fault_detected")
    c.start(head)
    assert c.job(head).state == "running"
    assert len(c.job(head).attempts[-1].nodes) == 4


def test_without_lending_the_same_job_waits_for_the_reservation(tmp_path: Path) -> None:
    c = lending_cluster(tmp_path, lend=False)
    first = c.submit(nodes=2, procs=1, time_limit="2")
    c.start(first)
    head = c.submit(nodes=4, procs=1, time_limit="2")
    borrower = c.submit(nodes=2, procs=1, time_limit="10")
    c.controller.step()
    assert c.job(borrower).state == "queued"
    assert c.job(borrower).reason == f"behind job {head} (priority 0)"
    assert not c.controller.store.attempts(borrower)


def test_a_lender_that_ran_elsewhere_and_waits_again_no_longer_lends(tmp_path: Path) -> None:
    """ADR 0050's loan is for one reservation: once its lender has started (elsewhere) and
    is queued again, it takes the borrower's nodes back only as any job may."""
    c = lending_cluster(tmp_path)
    first = c.submit(nodes=2, procs=1, time_limit="2")
    c.start(first)
    head = c.submit(nodes=4, procs=1, time_limit="2")
    borrower = c.submit(nodes=2, procs=1, time_limit="10")
    c.start(borrower)
    store = c.controller.store
    placed = store.attempts(borrower)[-1]
    assert placed.lent_by == (head,)
    now = c.clock.now()

    def lenders() -> tuple[int, ...]:
        snap = c.controller.planner.snapshot(c.clock.now())
        (running,) = [r for r in snap.running if r.id == borrower]
        return running.lent_by

    assert lenders() == (head,)
    # As if the head had run on other nodes and been requeued after the loan:
    ran = store.insert_attempt(head, 1, ["elsewhere-0"], "127.0.0.1", 1, 1, ts=now + 1)
    store.update_attempt(ran, state=AttemptState.CANCELLED.value, ended_at=now + 2)
    c.clock.advance(3)
    assert store.attempts(borrower)[-1].lent_by == (head,)  # the record keeps the loan
    assert lenders() == ()  # the scheduler no longer counts it
