"""`trainpod alloc`'s allocations on the controller, stepped by hand on a fake clock: the lease
their CLI renews, --time, a restarted controller, shell contexts and `trainpod run` steps."""

from __future__ import annotations

import pytest

from trainpod.api.models import StepRequest
from trainpod.controller.allocations import lease_s
from trainpod.errors import Conflict, SpecError
from trainpod.spec.job import JobSpec

from .conftest import PORT, Cluster, MakeCluster

HOLD = ["python", "-m", "trainpod.agent.hold"]


def allocate(c: Cluster, nodes: int = 2, **kw: object) -> int:
    spec = JobSpec(command=HOLD, nodes=nodes, procs_per_node=1, interactive=True, **kw)
    return c.controller.submit(spec)


def pass_time(c: Cluster, seconds: float, *, renew: int | None = None) -> None:
    """Let ``seconds`` go by in heartbeat-sized steps: the agents beat (they stay alive),
    the allocation ``renew`` has its lease renewed by its CLI, the loop runs."""
    left = seconds
    while left > 0:
        dt = min(left, c.cfg.heartbeat_interval_s * 2)
        c.clock.advance(dt)
        left -= dt
        c.beat()
        if renew is not None:
            c.controller.interactive.renew(renew)
        c.controller.step()


def finish_teardown(c: Cluster) -> None:
    for agent in c.agents.values():
        agent.kill_ranks(agent.beat())
        agent.beat()
    c.controller.step()


def test_an_allocation_outlives_a_renewing_cli_and_ends_when_it_falls_silent(
    cluster: Cluster,
) -> None:
    c = cluster
    job = allocate(c)
    c.start(job)
    assert c.job(job).state == "running"
    lease = lease_s(c.cfg)
    pass_time(c, 3 * lease, renew=job)  # renewed: it stands however long the shell runs
    assert c.job(job).state == "running" and not c.events("allocation_expired")

    pass_time(c, lease - 2 * c.cfg.heartbeat_interval_s)  # silent, within the lease
    assert c.job(job).state == "running"
    pass_time(c, 4 * c.cfg.heartbeat_interval_s)  # silent past it: the CLI is gone
    (expired,) = c.events("allocation_expired", job_id=job)
    assert "stopped renewing the lease" in expired.data["reason"]
    assert c.job(job).state == "stopping"
    finish_teardown(c)
    assert c.job(job).state == "cancelled"
    assert set(c.node_states().values()) == {"idle"}
    with pytest.raises(Conflict, match="has ended"):
        c.controller.interactive.renew(job)


def test_a_queued_allocation_whose_cli_died_leaves_the_queue(cluster: Cluster) -> None:
    c = cluster
    busy = c.submit(nodes=2)
    c.start(busy)
    job = allocate(c, nodes=1)
    c.controller.step()
    assert c.job(job).state == "queued"
    pass_time(c, lease_s(c.cfg) + 2 * c.cfg.heartbeat_interval_s)
    assert c.job(job).state == "cancelled"
    assert c.job(busy).state == "running"  # a plain job has no lease


def test_time_limit_ends_the_allocation_even_while_renewed(cluster: Cluster) -> None:
    c = cluster
    job = allocate(c, time_limit="1")  # one minute
    c.start(job)
    pass_time(c, 50, renew=job)
    lease = c.controller.interactive.renew(job)
    assert lease.ends_in_s is not None and 0 < lease.ends_in_s <= 10
    with pytest.raises(Conflict, match="is ending"):  # what its CLI hears, and says
        pass_time(c, 12, renew=job)
    (expired,) = c.events("allocation_expired", job_id=job)
    assert expired.data["reason"] == "its --time 1 ran out"
    finish_teardown(c)
    assert c.job(job).state == "cancelled"


def test_a_restarted_controller_gives_live_allocations_a_fresh_lease(cluster: Cluster) -> None:
    c = cluster
    job = allocate(c)
    c.start(job)
    lease = lease_s(c.cfg)
    pass_time(c, lease - 2 * c.cfg.heartbeat_interval_s)  # the CLI is silent ...
    c.restart_controller()  # ... while the controller restarts: no renewals reach it
    pass_time(c, lease - 2 * c.cfg.heartbeat_interval_s)
    assert c.job(job).state == "running"  # it counts from its start, not from before
    pass_time(c, 4 * c.cfg.heartbeat_interval_s)
    assert c.job(job).state == "stopping"


def test_release_records_why_and_cancels(cluster: Cluster) -> None:
    c = cluster
    job = allocate(c)
    c.start(job)
    c.controller.interactive.release(job, "the shell exited with status 0")
    (released,) = c.events("allocation_released", job_id=job)
    assert released.data["reason"] == "the shell exited with status 0"
    finish_teardown(c)
    assert c.job(job).state == "cancelled"
    c.controller.interactive.release(job, "again")  # idempotent once ended
    assert len(c.events("allocation_released", job_id=job)) == 1


def test_only_allocations_have_leases_and_steps(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(nodes=1)
    c.start(job)
    with pytest.raises(SpecError, match="is not an allocation"):
        c.controller.interactive.renew(job)
    with pytest.raises(SpecError, match="is not an allocation"):
        c.controller.interactive.start_step(job, StepRequest(command=["true"]))


def test_shell_context_of_an_allocation_and_of_a_node(cluster: Cluster) -> None:
    c = cluster
    job = allocate(c)
    with pytest.raises(Conflict, match="is queued"):
        c.controller.interactive.shell(None, job)
    c.start(job)
    nodes = c.job(job).attempts[-1].nodes
    ctx = c.controller.interactive.shell(None, job)
    assert ctx.node == nodes[0]  # the first node by default
    assert ctx.env["TRAINPOD_ALLOCATION"] == ctx.env["TRAINPOD_JOB_ID"] == str(job)
    assert ctx.env["TRAINPOD_NODES"] == ",".join(nodes)
    assert "WORLD_SIZE" not in ctx.env and "MASTER_PORT" not in ctx.env  # not a rank
    assert ctx.cwd == str(c.cfg.scratch_root / nodes[0] / f"job-{job}")
    assert c.controller.interactive.shell(nodes[1], job).node == nodes[1]

    other = c.controller.interactive.shell("workers-1", None)
    assert (other.job_id, other.cwd) == (None, str(c.cfg.scratch_root / "workers-1"))
    assert "TRAINPOD_JOB_ID" not in other.env


def test_shell_in_a_job_refuses_a_node_outside_it(make_cluster: MakeCluster) -> None:
    c = make_cluster(groups=[("workers", 3)])
    c.up()
    job = c.submit(nodes=2)
    c.start(job)
    outside = (set(c.agents) - set(c.job(job).attempts[-1].nodes)).pop()
    with pytest.raises(SpecError, match=f"{outside} is not one of job {job}'s nodes"):
        c.controller.interactive.shell(outside, job)
    assert "TRAINPOD_ALLOCATION" not in c.controller.interactive.shell(None, job).env


def test_a_step_gets_the_torchrun_contract_on_the_allocations_nodes(cluster: Cluster) -> None:
    c = cluster
    job = allocate(c)
    c.start(job)
    nodes = c.job(job).attempts[-1].nodes
    plan = c.controller.interactive.start_step(job, StepRequest(command=["python", "x.py"]))
    assert (plan.step, plan.nodes) == (1, nodes)
    first, second = (plan.orders[n] for n in nodes)
    # the nodes' 2 devices each: 2 ranks per node by default
    assert [s.rank for s in first.ranks] == [0, 1] and [s.rank for s in second.ranks] == [2, 3]
    assert first.env["WORLD_SIZE"] == "4" and second.env["NODE_RANK"] == "1"
    assert first.env["MASTER_PORT"] == str(PORT) and first.argv == ["python", "x.py"]
    assert first.env["TRAINPOD_STEP"] == "1" and first.env["TRAINPOD_ALLOCATION"] == str(job)
    assert first.env["TORCHELASTIC_RUN_ID"].endswith("-step-1")
    assert "TRAINPOD_ATTEMPT_ID" not in first.env  # its beacons are not the hold's
    assert first.log_dir.endswith(f"{job}/step-1")
    assert not c.events("job_submitted", job_id=job + 1)  # nothing was queued
    assert c.job(job).state == "running"

    two = c.controller.interactive.start_step(job, StepRequest(command=["true"], procs_per_node=1))
    assert two.step == 2 and two.orders[nodes[0]].env["WORLD_SIZE"] == "2"
    c.controller.interactive.end_step(job, 2, 3)
    (ended,) = c.events("step_ended", job_id=job)
    assert (ended.data["step"], ended.data["exit_code"]) == (2, 3)
    with pytest.raises(SpecError, match="has no step 9"):
        c.controller.interactive.end_step(job, 9, 0)
    with pytest.raises(SpecError, match="may not set RANK"):
        c.controller.interactive.start_step(job, StepRequest(command=["true"], env={"RANK": "3"}))


def test_a_step_of_an_accounts_allocation_logs_in_the_jobs_scratch(cluster: Cluster) -> None:
    """Its CLI runs as the account, which may not write under the cluster's home."""
    c = cluster
    job = allocate(c, nodes=1, account="alice")
    c.start(job)
    plan = c.controller.interactive.start_step(job, StepRequest(command=["true"]))
    for order in plan.orders.values():
        assert order.log_dir == f"{order.env['TRAINPOD_JOB_SCRATCH_DIR']}/step-1"
    plain = allocate(c, nodes=1)  # no account: under the cluster's jobs dir, as before
    c.start(plain)
    (order,) = c.controller.interactive.start_step(
        plain, StepRequest(command=["true"])
    ).orders.values()
    assert order.log_dir == str(c.cfg.jobs_dir / str(plain) / "step-1")
