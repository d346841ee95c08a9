"""``trainpod.elastic.run``: a training loop whose healthy ranks survive a peer's fault.

See ADR 0026. Per step: look at the recover file (one ``stat``), keep a copy of the state
(the last two) when one is due, run the user's step. A copy is due every k steps, k from the
measured cost of a copy and the faults seen (Young/Daly, ``trainpod.elastic.interval``),
agreed by every rank so that they all hold the same steps.

When a collective fails (a peer died, or Gloo's timeout ran out) or a newer recover message
appears, the rank destroys the process group, waits for the message, joins the new group on
the new store, agrees with the others on the newest step every rank holds, takes that state
from the lowest rank holding it (broadcast over the new group: data parallel, one copy fits
all) and runs on from there.

Gloo on CPU. NCCL's abort and re-init is the next slice: ``backend="nccl"`` is refused with
in-process recovery until then.
"""

from __future__ import annotations

import datetime
import functools
import gc
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from trainpod import beacon
from trainpod.elastic import interval
from trainpod.elastic.copies import copy_state
from trainpod.elastic.protocol import (
    ENV_FILE,
    ENV_GENERATION,
    ENV_RECOVERY,
    EXIT_RECOVERY_FAILED,
    IN_PROCESS,
    Recover,
    RecoverWatch,
)
from trainpod.mtbf import DEFAULT_MTBF_S
from trainpod.mtbf import mtbf_s as mtbf_s_of

_POLL_S = 0.02  # how often a rank that lost its group looks for the recover message
_COLLECTIVE_WORDS = ("gloo", "nccl", "connection closed", "connection reset", "timed out")


class Stateful(Protocol):
    """What ``torch.distributed.checkpoint`` calls Stateful: a model, an optimizer, …"""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


@dataclass(frozen=True)
class Recovery:
    """One in-process recovery as this rank saw it."""

    generation: int
    failed_step: int  # the step that was running (or about to run) when the fault showed
    resumed_step: int  # the step every rank went on from (its state: the start of that step)
    source: int  # the rank whose state everyone loaded
    cause: str
    seconds: float  # from the fault to the new group agreeing on the state
    rejoin_s: float  # of which: the new store and process group
    snapshot_every: int = 1  # the state was copied every this many steps when it came


@dataclass
class RunResult:
    steps: int  # the step count reached (== ``steps`` when it ran to the end)
    generation: int
    recoveries: list[Recovery] = field(default_factory=list)
    snapshot_every: int = 1  # the state was copied every this many steps, at the end


class RecoveryFailed(SystemExit):
    """The rank could not re-join in process: it exits with code 75 and the job falls back to
    a full restart. The reason is printed on stderr (the rank log's last line)."""

    def __init__(self, reason: str) -> None:
        super().__init__(EXIT_RECOVERY_FAILED)
        self.reason = reason


@dataclass(frozen=True)
class _Snapshot:
    step: int  # the state at the start of this step
    state: dict[str, dict[str, Any]]
    rng: torch.Tensor  # this rank's CPU generator then (restored with the state)


def is_collective_error(exc: BaseException) -> bool:
    """An error of a collective or of the store (a peer's fault), not of the step's own code."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _COLLECTIVE_WORDS)


def run(
    step_fn: Callable[[int], object],
    state: Mapping[str, Stateful],
    *,
    steps: int,
    start_step: int = 0,
    timeout_s: float = 10.0,
    wait_s: float = 60.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    on_group: Callable[[], object] | None = None,
    replicated: bool = True,
    resume: Callable[[], int | None] | None = None,
    snapshot_every: int | Literal["auto"] = "auto",
    mtbf_s: float | None = None,
) -> RunResult:
    """Run ``step_fn(step)`` for ``step`` in ``[start_step, steps)`` on every rank.

    ``state``: everything a step changes (model, optimizer, scheduler), as objects with
    ``state_dict``/``load_state_dict``. ``timeout_s``: Gloo's timeout for one collective (a
    rank whose neighbour is alive but stuck learns of a fault only this late; it must be more
    than the worst wait at a collective). ``wait_s``: how long a rank that lost its group
    waits for the agent's recover message. ``on_group``: called once every rank of a new
    group holds the same state, before the first step in it (and after the first join):
    what is bound to a process group is built there, e.g. ``DistributedDataParallel``
    (its reducer keeps the group it was made with). ``replicated``: every rank holds the
    whole state (data parallel), so a rank started fresh (a crashed rank, a lost node's on
    its replacement) takes it from a healthy peer; False (sharded state: tensor or pipeline
    parallel, ZeRO) makes every rank exit 75 instead when a peer is replaced, and the job
    falls back to a full restart from its checkpoint, with that reason in its events (a
    peer's fault that replaces nobody is still recovered in process). ``resume``: called
    once, after the first ``on_group``, by a rank that starts with the job (not one started
    fresh into a running group, which takes its state from a peer); it loads a checkpoint
    into ``state`` and returns the step to go on from, or None for ``start_step``. With a
    ``trainpod.Checkpointer``: construct it in ``on_group`` the first time and call its
    ``rebind()`` there after, and resume with ``load_latest`` (the step after the one it
    returns). ``snapshot_every``: copy the state in memory every this many steps; "auto"
    (the default) takes the interval that loses the least time, from the measured cost of a
    copy and of a step and the mean time between faults seen (``mtbf_s`` until a fault is
    seen; default ``$TRAINPOD_MTBF_S``, which the controller sets from the faults it
    observed, else 4 hours), decided by all ranks together when a
    group forms and after its first 20 steps. A fault redoes the steps since the newest
    copy. The last process group is left for the caller to use (close the
    Checkpointer, evaluate) and destroy (``dist.destroy_process_group()``). In a job without
    ``--recovery in-process`` this
    is a plain loop over the default process group (created here from the environment
    unless it exists), and any error is raised as usual.
    """
    e = os.environ if env is None else env
    if steps < start_step:
        raise ValueError(f"steps ({steps}) is less than start_step ({start_step})")
    if timeout_s <= 0 or wait_s <= 0:
        raise ValueError(f"timeout_s ({timeout_s}) and wait_s ({wait_s}) must be positive")
    whole = isinstance(snapshot_every, int) and not isinstance(snapshot_every, bool)
    if snapshot_every != "auto" and (not whole or int(snapshot_every) < 1):
        raise ValueError(
            f"snapshot_every must be a whole number of steps of at least 1, or 'auto', "
            f"not {snapshot_every!r}"
        )
    prior = _prior_mtbf(mtbf_s, e)
    if e.get(ENV_RECOVERY) != IN_PROCESS:
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        if on_group is not None:
            on_group()
        resumed = resume() if resume is not None else None
        for step in range(start_step if resumed is None else resumed, steps):
            step_fn(step)
        return RunResult(steps=steps, generation=0)
    if backend != "gloo":
        raise ValueError(
            f"in-process recovery supports the gloo backend in this version, not {backend!r}: "
            "pass backend='gloo' or submit without --recovery in-process"
        )
    if dist.is_initialized():
        raise RuntimeError(
            "trainpod.elastic.run creates the process group itself with in-process recovery "
            "(it must be able to destroy and re-create it): remove init_process_group"
        )
    loop = _Loop(
        step_fn,
        state,
        e,
        timeout_s=timeout_s,
        wait_s=wait_s,
        on_group=on_group,
        replicated=replicated,
        resume=resume,
        every=None if snapshot_every == "auto" else snapshot_every,
        prior_mtbf_s=prior,
    )
    return loop.run(start_step, steps)


def _prior_mtbf(mtbf_s: float | None, env: Mapping[str, str]) -> float:
    """The argument, else what the controller observed (``TRAINPOD_MTBF_S``), else 4 h."""
    if mtbf_s is not None and (not math.isfinite(mtbf_s) or mtbf_s <= 0):
        raise ValueError(f"mtbf_s must be a positive number of seconds, not {mtbf_s!r}")
    return mtbf_s_of(mtbf_s, env)


class _Loop:
    def __init__(
        self,
        step_fn: Callable[[int], object],
        state: Mapping[str, Stateful],
        env: Mapping[str, str],
        *,
        timeout_s: float,
        wait_s: float,
        on_group: Callable[[], object] | None,
        replicated: bool = True,
        resume: Callable[[], int | None] | None = None,
        every: int | None = None,
        prior_mtbf_s: float = DEFAULT_MTBF_S,
    ) -> None:
        self.step_fn = step_fn
        self.fixed_every = every  # None: auto
        self.prior_mtbf_s = prior_mtbf_s
        self.every = every or 1
        self.base = 0  # copies are due at base, base + every, ...
        self.tune_at: int | None = None  # the step at which the ranks agree on ``every`` again
        self.copy_s = 0.0  # a copy's cost, smoothed (0: none measured yet)
        self.step_s = 0.0  # a step's, copies left out
        self.started = time.monotonic()
        self.resume = resume
        self.replicated = replicated
        self.on_group = on_group
        self.state = state
        self.rank = int(env["RANK"])
        self.world = int(env["WORLD_SIZE"])
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        path = env.get(ENV_FILE)
        self.generation = int(env.get(ENV_GENERATION, "0") or 0)
        attempt = env.get("TRAINPOD_ATTEMPT_ID", "")
        self.watch = RecoverWatch(
            Path(path) if path else None,
            self.generation,
            attempt_id=int(attempt) if attempt.isdigit() else None,
        )
        self.addr = env["MASTER_ADDR"]
        self.port = int(env["MASTER_PORT"])
        self.agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        self.snapshots: deque[_Snapshot] = deque(maxlen=2)
        self.store: dist.TCPStore | None = None
        self.result = RunResult(steps=0, generation=self.generation)

    # -- the loop -----------------------------------------------------------------------
    def run(self, start_step: int, steps: int) -> RunResult:
        step = start_step
        if self.generation > 0:
            self._need_peer_state("this rank starts fresh")
        self._join(self.addr, self.port, deadline_s=self.wait_s)
        if self.generation > 0:  # a replacement: take the state from a healthy peer
            t0 = time.monotonic()
            step, source = self._agree(start_step)
            took = time.monotonic() - t0
            self._log(f"joined generation {self.generation} at step {step} from rank {source}")
            self.result.recoveries.append(
                Recovery(self.generation, start_step, step, source, "replacement", took, took)
            )
        self._grouped()
        if self.generation == 0 and self.resume is not None:
            resumed = self.resume()
            if resumed is not None:
                step = resumed
        self._tune(step)
        while step < steps:
            message = self.watch.poll()
            if message is not None:
                # Between steps: the state now is the start of ``step``, keep it too.
                self._snapshot(step)
                step = self._recover(step, f"recover message {message.generation}", message)
                continue
            if step == self.tune_at:
                cause = self._collective(functools.partial(self._tune, step))
                if cause is not None:
                    step = self._recover(step, cause, None)
                    continue
            if (step - self.base) % self.every == 0:
                self._snapshot(step)
            cause = self._step(step)
            if cause is not None:  # outside the ``except``: see _step
                step = self._recover(step, cause, None)
                continue
            step += 1
        # The last group stays, as in a plain loop: the caller may still need it (close a
        # Checkpointer, whose commits are collectives; evaluate) and destroys it at the end.
        # Its collectives get torch's default timeout again: the short one is for detecting a
        # peer's fault between steps, not for a final close or evaluation.
        c10d._set_pg_timeout(c10d.default_pg_timeout)
        self.result.steps = step
        self.result.generation = self.generation
        self.result.snapshot_every = self.every
        return self.result

    def _step(self, step: int) -> str | None:
        """Run one step; the collective error that ended it, or None.

        Only the error's text leaves here. The exception's traceback holds the frames of the
        failed collective, and they hold the process group: while it lives, destroying the
        group frees nothing, its Gloo sockets stay open, and a peer whose ring neighbour is
        this rank (alive) learns of the fault only at its collective timeout (5 s of the
        5.8 s recovery ADR 0026 measured). Once the group is really freed its sockets
        close, and every peer blocked on them fails at once ("connection closed by peer"):
        the fault spreads through the ring in milliseconds."""
        t0 = time.perf_counter()
        cause = self._collective(lambda: self.step_fn(step))
        if cause is None:
            self.step_s = _smooth(self.step_s, time.perf_counter() - t0)
        return cause

    @staticmethod
    def _collective(fn: Callable[[], object]) -> str | None:
        """Run ``fn``; the collective error that ended it (its text only: see _step)."""
        try:
            fn()
        except Exception as exc:
            if not is_collective_error(exc):
                raise
            return _short(exc)
        return None

    # -- recovering ---------------------------------------------------------------------
    def _recover(self, failed_step: int, cause: str, message: Recover | None) -> int:
        t0 = time.monotonic()
        every = self.every
        self._log(f"step {failed_step}: {cause}; leaving generation {self.generation}")
        self._teardown()
        if message is None:
            # "My group is lost and I wait": a peer that hangs (alive, silent) is told apart
            # from the ranks waiting for it by this, and replaced in process (ADR 0026).
            beacon.heartbeat(lost_generation=self.generation)
        last_error = cause
        while True:
            message = message or self._wait_message(t0, last_error)
            if message.replaced:
                self._need_peer_state(f"rank {', '.join(map(str, message.replaced))} starts fresh")
            t1 = time.monotonic()
            try:
                self._join(message.master_addr, message.master_port, deadline_s=message.deadline_s)
                self.generation = self.watch.generation = message.generation
                step, source = self._agree(failed_step)
                self._grouped()
                self._tune(step)
            except Exception as exc:  # a second fault while forming the group
                last_error = f"re-joining generation {message.generation} failed: {_short(exc)}"
                self._log(last_error)
                self._teardown()
                self.watch.generation = max(self.watch.generation, message.generation)
                message = None
                continue
            done = time.monotonic()
            self.result.recoveries.append(
                Recovery(
                    message.generation,
                    failed_step,
                    step,
                    source,
                    cause,
                    done - t0,
                    done - t1,
                    snapshot_every=every,
                )
            )
            self._log(
                f"generation {message.generation}: resumed at step {step} (state of rank "
                f"{source}) {done - t0:.3f}s after the fault (re-join {done - t1:.3f}s)"
            )
            return step

    def _snapshot(self, step: int) -> None:
        """Keep the state at the start of ``step``; the oldest of two lends its buffers.
        (After a rollback the deque is empty: a loaded snapshot is never written into.)"""
        t0 = time.perf_counter()
        evicted = self.snapshots[0] if len(self.snapshots) == 2 else None
        state = copy_state(self.state, evicted.state if evicted else None)
        rng = torch.get_rng_state()
        self.snapshots.append(_Snapshot(step, state, rng))
        self.copy_s = _smooth(self.copy_s, time.perf_counter() - t0)

    def _tune(self, step: int) -> None:
        """Every rank of the group, at the same ``step``: agree on how often to copy the
        state from here on (the largest of each rank's figures: one collective)."""
        self.base = step
        if self.fixed_every is not None:
            self.every, self.tune_at = self.fixed_every, None
            return
        elapsed = time.monotonic() - self.started
        mine = [self.copy_s, self.step_s, elapsed, float(len(self.result.recoveries))]
        figures = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        copy_s, step_s, elapsed_s, faults = figures.tolist()
        agreed = interval.Agreed(copy_s, step_s, elapsed_s, int(faults))
        self.every = interval.every_steps(agreed, self.prior_mtbf_s)
        self.tune_at = None if agreed.measured else step + interval.WARMUP_STEPS
        if agreed.measured and self.rank == 0:
            m = interval.mtbf(agreed.elapsed_s, agreed.faults, self.prior_mtbf_s)
            self._log(
                f"copying the state every {self.every} steps from step {step} (a copy "
                f"{copy_s * 1000:.1f} ms, a step {step_s * 1000:.1f} ms, {agreed.faults} "
                f"faults in {elapsed_s:.0f}s: MTBF {m:.0f}s)"
            )

    def _grouped(self) -> None:
        # "I joined this generation": the controller's confirmation waits for every rank's
        # (ADR 0035). A beacon never blocks nor raises; outside trainpod it is a no-op.
        beacon.heartbeat(generation=self.generation, collective_timeout_s=self.timeout_s)
        if self.on_group is not None:
            self.on_group()

    def _need_peer_state(self, why: str) -> None:
        if self.replicated:
            return
        reason = (
            f"in-process recovery failed: {why} and needs a peer's copy of its state, but the "
            "state is sharded (replicated=False): a full restart loads it from the checkpoint"
        )
        self._log(reason)
        raise RecoveryFailed(reason)

    def _wait_message(self, since: float, why: str) -> Recover:
        deadline = since + self.wait_s
        while True:
            message = self.watch.poll()
            if message is not None:
                return message
            if time.monotonic() > deadline:
                reason = (
                    f"in-process recovery failed: no recover message newer than generation "
                    f"{self.watch.generation} within {self.wait_s:g}s after: {why}"
                )
                self._log(reason)
                raise RecoveryFailed(reason)
            time.sleep(_POLL_S)

    def _join(self, addr: str, port: int, *, deadline_s: float) -> None:
        # A fresh port per generation, so nothing of the old group can answer. The node
        # leader's agent hosts each generation's store as it hosts the attempt's (ADR 0028);
        # without an agent (TORCHELASTIC_USE_AGENT_STORE not True) rank 0 does, as env:// does.
        self.store = dist.TCPStore(
            addr,
            port,
            self.world,
            is_master=self.rank == 0 and not self.agent_store,
            timeout=datetime.timedelta(seconds=deadline_s),
        )
        dist.init_process_group(
            "gloo",
            store=self.store,
            rank=self.rank,
            world_size=self.world,
            # Joining waits for the slowest rank (a replacement starting its interpreter):
            # the deadline. The collectives after it get the short timeout.
            timeout=datetime.timedelta(seconds=max(deadline_s, self.timeout_s)),
        )
        c10d._set_pg_timeout(datetime.timedelta(seconds=self.timeout_s))

    def _agree(self, fallback_step: int) -> tuple[int, int]:
        """Every rank says which steps it holds; all load the newest one every rank has."""
        held = [s.step for s in self.snapshots] + [-1, -1]
        mine = torch.tensor(held[:2], dtype=torch.int64)
        rows = [torch.empty(2, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(rows, mine)
        newest = [int(r.max()) for r in rows]
        holders = [n for n in newest if n >= 0]
        if not holders:  # nobody has run a step yet: everyone starts from its own start
            return fallback_step, self.rank
        target = min(holders)
        source = min(i for i, r in enumerate(rows) if target in r.tolist())
        box: list[object] = [None]
        own = next((s for s in self.snapshots if s.step == target), None)
        if self.rank == source:
            assert own is not None
            box[0] = (own.state, own.rng)
        dist.broadcast_object_list(box, src=source)
        chosen = box[0]
        assert isinstance(chosen, tuple)
        state, rng = chosen
        for key, obj in self.state.items():
            obj.load_state_dict(state[key])
        # The random stream: a rank's own where it holds the step, else the source's (a
        # rank started fresh has none of its own at that step).
        torch.set_rng_state(own.rng if own is not None else rng)
        self.snapshots.clear()
        return target, source

    def _teardown(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a broken group may fail to say goodbye
                self._log(f"destroying the old process group: {_short(exc)}")
            # What still points at the old group (a cycle through a failed collective's
            # frames) goes now, so its sockets close and the peers stop waiting (_step).
            gc.collect()
        # A join that failed half way may have named a group it never registered: the next
        # group's store keys must start from the same count on every rank (0, as after
        # destroy_process_group), or two ranks wait for each other's keys under other names.
        c10d._world.group_count = 0
        self.store = None

    def _log(self, text: str) -> None:
        print(f"trainpod.elastic: rank {self.rank}: {text}", file=sys.stderr, flush=True)


def _smooth(old: float, new: float, weight: float = 0.2) -> float:
    return new if old <= 0 else old + weight * (new - old)


def _short(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:300]}"
