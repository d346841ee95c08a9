"""``trainpod.elastic.run`` in one process (a world of one over Gloo): the plain loop, the
refusals, a planned re-forming of the group, and which errors count as a peer's fault.
The fault cases across real ranks are in tests/integration/test_elastic_ranks.py."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainpod import beacon
from trainpod.elastic import Recover, is_collective_error, recover_file, run, write_recover


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Counter:
    """A Stateful thing a step changes."""

    def __init__(self) -> None:
        self.value = torch.zeros(1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.value = state["value"].clone()


@pytest.fixture(autouse=True)
def no_group_left() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def env(tmp_path: Path) -> dict[str, str]:
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "TRAINPOD_RECOVERY": "in-process",
        "TRAINPOD_RECOVER_FILE": str(recover_file(tmp_path)),
    }


def test_without_the_opt_in_it_is_a_plain_loop_over_the_existing_group() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ran: list[int] = []
    built: list[int] = []
    result = run(ran.append, {}, steps=5, start_step=2, env={}, on_group=lambda: built.append(1))
    assert ran == [2, 3, 4]
    assert built == [1]
    assert (result.steps, result.generation, result.recoveries) == (5, 0, [])


def test_a_recover_message_between_steps_re_forms_the_group_and_loses_no_step(
    tmp_path: Path,
) -> None:
    counter = Counter()
    ran: list[int] = []
    groups: list[int] = []
    e = env(tmp_path)

    def step(n: int) -> None:
        t = torch.ones(1)
        dist.all_reduce(t)  # the group works in every generation
        counter.value += t
        ran.append(n)
        if n == 3:  # the agent publishes generation 1 while step 3 runs
            message = Recover(1, 1, "127.0.0.1", free_port(), 1)
            write_recover(Path(e["TRAINPOD_RECOVER_FILE"]), message)

    result = run(step, {"c": counter}, steps=8, env=e, on_group=lambda: groups.append(1))
    assert ran == list(range(8))  # nothing redone: the state between steps is kept
    assert counter.value.item() == 8
    assert result.generation == 1
    [rec] = result.recoveries
    assert (rec.failed_step, rec.resumed_step, rec.source) == (4, 4, 0)
    assert groups == [1, 1]  # built in generation 0 and again in generation 1


def test_a_rank_whose_collective_failed_says_it_lost_its_group_and_one_told_to_leave_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the controller tells a stuck peer from the ranks waiting for it by (ADR 0026):
    each join says the generation and the collective timeout; a failed collective says
    ``lost_generation``; leaving on a recover message between steps says nothing of a loss."""
    said: list[dict[str, object]] = []
    monkeypatch.setattr(beacon, "heartbeat", lambda **kw: said.append(kw))
    e = env(tmp_path)

    failed: list[int] = []

    def step(n: int) -> None:
        if n == 2 and not failed:  # a peer died in this step's collective; generation 1 comes
            failed.append(n)
            write_recover(
                Path(e["TRAINPOD_RECOVER_FILE"]), Recover(1, 1, "127.0.0.1", free_port(), 1)
            )
            raise RuntimeError("[gloo] Connection closed by peer")
        if n == 5:  # generation 2 is published between steps: nothing was lost
            write_recover(
                Path(e["TRAINPOD_RECOVER_FILE"]), Recover(2, 1, "127.0.0.1", free_port(), 1)
            )

    result = run(step, {"c": Counter()}, steps=8, env=e, timeout_s=7.5, snapshot_every=1)
    assert result.generation == 2
    assert said == [
        {"generation": 0, "collective_timeout_s": 7.5},
        {"lost_generation": 0},
        {"generation": 1, "collective_timeout_s": 7.5},
        {"generation": 2, "collective_timeout_s": 7.5},
    ]


def test_an_error_of_the_step_itself_is_raised_not_recovered(tmp_path: Path) -> None:
    def step(n: int) -> None:
        raise ValueError(f"bad batch at step {n}")

    with pytest.raises(ValueError, match="bad batch at step 0"):
        run(step, {}, steps=3, env=env(tmp_path))


def test_in_process_recovery_must_own_the_group(tmp_path: Path) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(RuntimeError, match="remove init_process_group"):
        run(lambda n: None, {}, steps=1, env=env(tmp_path))


def test_nccl_is_refused_with_in_process_recovery_for_now(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="supports the gloo backend"):
        run(lambda n: None, {}, steps=1, backend="nccl", env=env(tmp_path))


def test_bad_arguments_say_which() -> None:
    with pytest.raises(ValueError, match=r"steps \(1\) is less than start_step \(2\)"):
        run(lambda n: None, {}, steps=1, start_step=2, env={})
    with pytest.raises(ValueError, match="must be positive"):
        run(lambda n: None, {}, steps=1, timeout_s=0, env={})


def test_which_errors_are_a_peers_fault() -> None:
    gloo = "[../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"
    assert is_collective_error(RuntimeError(gloo))
    assert is_collective_error(dist.DistStoreError("wait timeout after 5000ms"))
    assert not is_collective_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_error(ValueError("connection reset by peer"))  # not torch's


def test_a_snapshot_is_a_copy_and_reuses_the_evicted_ones_buffers() -> None:
    from trainpod.elastic.copies import copy_state

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt}
    first = copy_state(state)
    with torch.no_grad():
        model.weight += 1
    assert not torch.equal(first["model"]["weight"], model.weight)  # a copy, not a view
    buffer = first["model"]["weight"]
    second = copy_state(state, reuse=first)
    assert second["model"]["weight"] is buffer  # written into, not allocated
    assert torch.equal(second["model"]["weight"], model.weight)
    momentum = second["optim"]["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, opt.state[model.weight]["momentum_buffer"])
    assert second["optim"]["param_groups"] == opt.state_dict()["param_groups"]


def _copies_seen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps at which the loop copies the state, in order (the copies still happen)."""
    from trainpod.elastic import loop

    copied: list[int] = []
    real = loop._Loop._snapshot

    def spy(self: loop._Loop, step: int) -> None:
        copied.append(step)
        real(self, step)

    monkeypatch.setattr(loop._Loop, "_snapshot", spy)
    return copied


def test_copies_are_taken_every_k_steps_counted_from_the_groups_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``snapshot_every=3`` from step 2: copies at 2, 5, 8; a recover message at step
    9 copies the state there too, and nothing is redone."""
    copied = _copies_seen(monkeypatch)
    e = env(tmp_path)
    ran: list[int] = []

    def step(n: int) -> None:
        ran.append(n)
        if n == 8:
            write_recover(
                Path(e["TRAINPOD_RECOVER_FILE"]), Recover(1, 1, "127.0.0.1", free_port(), 1)
            )

    result = run(step, {"c": Counter()}, steps=12, start_step=2, env=e, snapshot_every=3)
    assert ran == list(range(2, 12))
    assert copied == [2, 5, 8, 9, 9]  # 9: kept at the message, and the new group's first
    assert result.snapshot_every == 3


def test_auto_copies_every_step_until_the_ranks_agree_on_the_costs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "auto": every step for the first 20 steps of a group, then the Young/Daly interval
    from what was measured (a cheap copy and no fault in an hour: many steps apart)."""
    copied = _copies_seen(monkeypatch)

    def step(n: int) -> None:
        time.sleep(0.001)  # a step costs more than a copy of one small tensor

    result = run(step, {"c": Counter()}, steps=60, env=env(tmp_path), mtbf_s=3600.0)
    assert copied[:21] == list(range(21))  # 20 steps, then the agreement at step 20
    assert result.snapshot_every > 1
    every = result.snapshot_every
    assert copied[21:] == list(range(20 + every, 60, every))


def test_a_bad_interval_or_mtbf_says_what_to_pass(tmp_path: Path) -> None:
    for bad in (0, -1, 2.5, True, "often"):
        with pytest.raises(ValueError, match="snapshot_every must be a whole number"):
            run(lambda n: None, {}, steps=1, env=env(tmp_path), snapshot_every=bad)  # type: ignore[arg-type]
    for bad_mtbf in (0.0, -5.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="mtbf_s must be a positive number"):
            run(lambda n: None, {}, steps=1, env=env(tmp_path), mtbf_s=bad_mtbf)
