"""The public :class:`Checkpointer`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from trainpod import beacon, notice
from trainpod.ckpt.coll import Coll
from trainpod.ckpt.errors import CheckpointConfigError, CheckpointError
from trainpod.ckpt.fullness import fallbacks
from trainpod.ckpt.handoff import AgentLink, AgentPersistence, TierConfig, build_tiers, env_int
from trainpod.ckpt.interval import (
    CostMeter,
    Costs,
    IntervalBounds,
    MonotonicClock,
    interval_steps,
)
from trainpod.ckpt.interval import interval_s as auto_interval_s
from trainpod.ckpt.layout import Layout, mtbf_is_prior, private_dir, resolve
from trainpod.ckpt.layout import mtbf_s as mtbf_s_of
from trainpod.ckpt.loader import LoadResult, load_latest
from trainpod.ckpt.pipeline import Pipeline
from trainpod.ckpt.records import Ctx, EventHook, Progress, Snapshot
from trainpod.ckpt.staging import Stager
from trainpod.ckpt.tiers import FsTier, Meter, Tier
from trainpod.clock import Clock

log = logging.getLogger(__name__)

DEFAULT_KEEP = {"memory": 2, "scratch": 2, "peer": 1, "durable": 3}
AUTO_WARMUP_STEPS = 5
"""With ``interval="auto"``: steps timed before the first save, and from it to the second."""


def default_tiers(
    layout: Layout,
    *,
    keep: Mapping[str, int],
    peer: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Tier]:
    """memory → scratch → peer → durable, as far as ``layout`` has them (fastest first)."""
    return build_tiers(
        TierConfig.of_layout(layout, keep=keep, peer=peer, storage_options=storage_options)
    )


def node_ring(rank_nodes: list[str], listed: tuple[str, ...]) -> tuple[str, ...]:
    """The job's nodes in ring order (peer copies go to the next one), the same on every
    rank: the list rank 0 was given (``TRAINPOD_NODES``) where it names the nodes the ranks
    are on, else those nodes in rank order. After a lost node's ranks started on a spare in
    the same attempt (ADR 0035), the ranks that stayed were given the old list."""
    actual = tuple(dict.fromkeys(rank_nodes))
    return listed if len(listed) > 1 and set(listed) == set(actual) else actual


class Checkpointer:
    """Tiered asynchronous checkpoints of a training state, in PyTorch DCP format.

    ``save`` blocks only for the copy into staging memory; writing into the shared-memory
    tier and the commit run on a background thread with its own Gloo process group (none
    outside a distributed run). The copies to scratch, peer and durable tiers are made by the
    node's trainpod agent when there is one (a process of its own that outlives a crashed
    worker and does not compete for this process's GIL), else by a second background thread.

    Construct it on every rank at the same point (with ``torch.distributed`` initialized, it
    creates two process groups, a collective). ``save``, ``load_latest``, ``due``, ``wait``
    and ``close`` are collective in effect and must be called by every rank in the same
    order, from the training thread; ``progress`` and ``last_load`` may be read from any
    thread.

    Args:
        dir: durable location (path or fsspec URL). Default: ``TRAINPOD_CHECKPOINT_DIR`` or
            ``TRAINPOD_CHECKPOINT_URI``.
        every: save when ``step % every == 0``. Exclusive with ``interval``.
        interval: ``"auto"`` (the default when ``every`` is None): Young/Daly,
            ``sqrt(2 * stall * MTBF)``, from the running median of this process's save
            stalls and the MTBF, within ``bounds``, in steps of the measured step time,
            agreed by all ranks (:mod:`trainpod.ckpt.interval`).
        mtbf_s: the MTBF for ``interval="auto"``: seconds, or a callable asked at every save
            (for a source that learns of faults while the process lives); default
            ``TRAINPOD_MTBF_S`` (what the controller observed, given at launch), else 4 h.
        bounds: limits of the automatic interval (default: 1 s to 30 min, every step at most).
        clock: times the steps for the automatic interval (default: ``time.monotonic``).
        keep: checkpoints kept per tier, one int for all or a mapping by tier name.
        memory: shared-memory tier on (``/dev/shm/trainpod``), off, or rooted at a path.
        scratch_dir: node scratch root (default: ``TRAINPOD_JOB_SCRATCH_DIR``).
        peer: copy each node's part to the next node's scratch when there are several nodes.
        storage_options: passed to fsspec for the durable URL.
        bandwidth_bps: cap on bytes/s copied to peer and durable tiers (None: unlimited).
        verify: check the checksum of every file read at load (a size check only when False).
        tiers: replace the default tiers (first = node-local primary written by DCP).
        on_event: ``(event, step)`` hook called from the background threads.
        timeout_s: timeout of the checkpointer's process groups.
        retry_base_s: first backoff of a failed durable copy (doubling up to 60 s).
        agent: hand the copies to the node's trainpod agent (``TRAINPOD_CKPT_SOCKET``): None
            (default) when one answers and ``tiers`` is not given, True to require it, False
            to copy in this process.
        stage_in_files: from the second save of a state on, stage it straight into the
            shared-memory tier's files, so the copy is that tier's write (ADR 0053); only
            where every tensor is a CPU tensor or a DTensor's CPU shard and DCP writes all
            of this rank's (not replicated ones).
        reuse_files: the copies into scratch, peer and a durable store on a local path write
            over the files of the step they pruned instead of allocating new ones (ADR 0056).
            Measured on a 2-core VM: the durable copy about 20% sooner; its cost to the
            training loop while copying came out worse in one set of runs and not in
            another, so it is off by default (the checkpoint benchmark shows both).

    Raises:
        CheckpointConfigError: no durable location and no ``tiers``, or no local tier.
    """

    def __init__(
        self,
        dir: str | os.PathLike[str] | None = None,
        *,
        every: int | None = None,
        interval: Literal["auto"] | None = None,
        keep: int | Mapping[str, int] | None = None,
        memory: bool | str | os.PathLike[str] = True,
        scratch_dir: str | os.PathLike[str] | None = None,
        peer: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        bandwidth_bps: float | None = None,
        mtbf_s: float | Callable[[], float] | None = None,
        bounds: IntervalBounds | None = None,
        clock: Clock | None = None,
        verify: bool = True,
        tiers: Sequence[Tier] | None = None,
        on_event: EventHook | None = None,
        timeout_s: float = 1800.0,
        retry_base_s: float = 1.0,
        agent: bool | None = None,
        stage_in_files: bool = True,
        reuse_files: bool = False,
    ) -> None:
        if every is not None and interval is not None:
            raise CheckpointConfigError(f"got every={every} and interval={interval!r}; pass one")
        if every is not None and every < 1:
            raise CheckpointConfigError(f"every must be >= 1, got {every}")
        if interval not in (None, "auto"):
            raise CheckpointConfigError(f"interval must be 'auto' or None, got {interval!r}")
        self.every = every
        if isinstance(mtbf_s, int | float) and not mtbf_s > 0:
            raise CheckpointConfigError(f"mtbf_s must be > 0 seconds, got {mtbf_s!r}")
        self._mtbf: Callable[[], float]
        # No MTBF given nor observed yet: the interval is capped while it is a guess (0035).
        self._mtbf_prior = mtbf_s is None and mtbf_is_prior()
        if callable(mtbf_s):
            self._mtbf = mtbf_s
        else:
            fixed = mtbf_s_of(mtbf_s)
            self._mtbf = lambda: fixed
        self.bounds = bounds if bounds is not None else IntervalBounds()
        self.layout = resolve(
            dir, memory=memory, scratch_dir=scratch_dir, require_durable=tiers is None
        )
        kept = dict(DEFAULT_KEEP)
        if isinstance(keep, int):
            kept = dict.fromkeys(kept, keep)
        elif keep is not None:
            kept.update(keep)
        config = TierConfig.of_layout(
            self.layout,
            keep=kept,
            peer=peer,
            storage_options=storage_options,
            bandwidth_bps=bandwidth_bps,
            reuse_files=reuse_files,
        )
        self.tiers = list(tiers) if tiers is not None else build_tiers(config)
        primary = self.tiers[0] if self.tiers else None
        if not (isinstance(primary, FsTier) and primary.local and primary.node_scoped):
            raise CheckpointConfigError(
                f"the first tier must be a node-local directory DCP can write to, got {primary!r};"
                " enable memory=True or give scratch_dir="
            )
        self._primary: FsTier = primary
        if self.layout.memory is not None and any(t.name == "memory" for t in self.tiers):
            private_dir(self.layout.memory.parent)  # the job's dir: this account's alone
        self.verify = verify
        self._timeout_s = timeout_s
        self._config = config
        self._on_event = on_event
        self._retry_base_s = retry_base_s
        self._stage_in_files = stage_in_files
        self.last_load: LoadResult | None = None
        """What the last :meth:`load_latest` did, with the reasons for any fallback."""
        self.last_stall_s: float | None = None
        self._costs = CostMeter(clock if clock is not None else MonotonicClock())
        self._last_step = 0
        self._saved_step: int | None = None
        self._next_due: int | None = None
        self._closed = False
        self._abandoned: list[Pipeline] = []
        """Pipelines of earlier process groups whose threads may still run (:meth:`rebind`)."""
        self.meter = Meter(bandwidth_bps, on_progress=self._report_progress)
        self._stager = Stager()
        self.agent: AgentPersistence | None = None
        """The hand-off to the node's agent (None: this process copies)."""
        self._bind(self._agent_link(agent, tiers is not None, config), required=bool(agent))
        self._agree_schedule()

    # ------------------------------------------------------------------ public API
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Snapshot ``state`` for ``step`` and return; everything else runs in the background.

        Blocking for the copy into staging buffers (plus, under back-pressure, the wait for
        the previous snapshot to leave them). ``state`` maps names to tensors, DTensors,
        ``Stateful`` objects (``state_dict``/``load_state_dict``) and plain values. Reports
        ``checkpoint_stall_s`` through :func:`trainpod.report`. Raises
        :class:`CheckpointError` after :meth:`close`, ``ValueError`` for unsaveable values.
        """
        if self._closed:
            raise CheckpointError("save() after close(); create a new Checkpointer")
        t0 = time.perf_counter()
        self._pipe.staging_free.wait()
        staged, framed = self._stager.stage_framed(state, self._pipe.framed)
        stall = time.perf_counter() - t0
        for seconds in self._pipe.take_write_times():
            self._costs.writes.add(seconds)
        self._costs.stalls.add(stall)
        auto = self.every is None
        proposal = self._costs.costs(self._mtbf_now(), prior=self._mtbf_prior) if auto else None
        # The interval agreed at the previous save, read before this one is handed to the
        # writer: it agrees on this save's proposal in the background, and a rank that read
        # after it had would disagree with one that read before on the next save's step.
        interval = self._agreed_interval() if self.every is None else None
        nbytes = self._stager.nbytes()
        self._pipe.submit(Snapshot(step, staged, proposal, stall, nbytes=nbytes, framed=framed))
        stall = time.perf_counter() - t0
        self.last_stall_s = stall
        self._last_step = max(self._last_step, step)
        self._saved_step = step
        metrics: dict[str, float | int] = {"checkpoint_stall_s": stall}
        if self.every is None:
            self._next_due = step + (interval or AUTO_WARMUP_STEPS)
            if interval is not None:
                metrics["checkpoint_interval_steps"] = interval
                metrics["checkpoint_interval_s"] = self.interval_s() or 0.0
        self._costs.saved(None)  # the next step-time sample starts after the save
        beacon.report(step, **metrics)

    def rebind(self) -> None:
        """Carry on in a re-formed process group, after an in-process recovery.

        Call it from ``trainpod.elastic.run``'s ``on_group`` on every rank that kept this
        Checkpointer, at the point where a rank started fresh constructs its own: the two
        run the same collectives on the new group. Saves not committed yet are given up
        without a collective (their process groups went with the old one); a commit the old
        group's ranks completed together stands, its parts gathered from every rank. The
        new group gets its own process groups and threads, and the save schedule (the last
        saved step, the next due, the agreed costs of ``interval="auto"``) is agreed again,
        so a rank started fresh saves at the same steps as the others. While an old writer
        still runs on any rank (a collective of the old group ends when its peers leave or
        at ``timeout_s``), saves are skipped, with a ``skipped`` event.
        """
        if self._closed:
            raise CheckpointError("rebind() after close(); create a new Checkpointer")
        old = self._pipe
        old.abandon("the process group was re-formed (in-process recovery)")
        self._abandoned = [p for p in self._abandoned if p.busy()] + [old]
        if not old.staging_free.is_set():
            self._stager = Stager()  # the old writer may still be reading its buffers
        link = self.agent.link if self.agent is not None else None
        self._bind(link, required=False, inherit=old)
        self._agree_schedule()
        self._costs.saved(None)  # the recovery's pause is not a step

    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Load the newest intact committed checkpoint into ``state`` (in place); its step.

        None on a fresh start. Collective and blocking; prefers the fastest tier, verifies
        checksums, falls back tier by tier and step by step; :attr:`last_load` has the
        reasons (also logged and reported). Raises only if the process group fails.
        """
        self._pipe.wait(local_only=True)  # the writer thread shares this group
        result = load_latest(self.ctx, self._write_coll, self.tiers, state, verify=self.verify)
        self.last_load = result
        for why in result.reasons:
            log.warning("rank %d: checkpoint passed over: %s", self.ctx.rank, why)
        if result.step is not None:
            log.info("rank %d: loaded step %d from %s", self.ctx.rank, result.step, result.tier)
            self._saved_step = result.step
            self._last_step = max(self._last_step, result.step)
            self._next_due = result.step + AUTO_WARMUP_STEPS
            self._costs.restart()
        beacon.report(
            self._last_step,
            checkpoint_loaded_step=-1 if result.step is None else result.step,
            checkpoint_load_tier=result.tier or "",
            checkpoint_load_s=result.seconds,
            checkpoint_load_fallbacks=len(result.reasons),
            checkpoint_load_reasons=" | ".join(result.reasons)[:2000],
        )
        return result.step

    def due(self, step: int) -> bool:
        """Whether to save after ``step``. Cheap, non-blocking; call it once per step.

        The same on every rank: fixed ``every``, or the automatic interval agreed at the
        previous save (the first automatic save comes after a few timed steps).
        """
        self._costs.step(step)
        self._last_step = max(self._last_step, step)
        if step == self._saved_step:
            return False
        if self.every is not None:
            return step % self.every == 0
        if self._next_due is None:
            self._next_due = step + AUTO_WARMUP_STEPS
        return step >= self._next_due

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every save so far is committed in every tier it will reach (a failing
        durable store keeps this waiting: use a timeout). True when done, False on timeout."""
        return self._pipe.wait(timeout_s)

    def close(self, timeout_s: float | None = None, *, release_memory: bool | None = None) -> bool:
        """Finish pending copies (up to ``timeout_s``) and stop the threads. Idempotent;
        collective. True when everything was committed and the threads ended.

        ``release_memory``: remove this node's shared-memory tier (RAM in ``/dev/shm``) once
        another tier holds the newest step. The default (None) does so outside trainpod,
        where nobody else would; under trainpod the node's agent removes it when the job
        ends, so a restarted attempt can still load from it. It is kept, with a warning, when
        it may hold the only copy of the newest step."""
        if self._closed:
            return True
        self._closed = True
        done = self._pipe.close(timeout_s)
        if release_memory is None:
            release_memory = not self.layout.managed
        if release_memory and self.ctx.leader:
            self._release_memory(done)
        return done

    @staticmethod
    def _newest_in(tiers: Iterable[Tier]) -> int | None:
        """The newest committed step in any of ``tiers`` (a tier that cannot be read: none)."""
        steps = []
        for tier in tiers:
            with contextlib.suppress(OSError, CheckpointError):
                steps += [loc.step for loc in tier.locate()[0]]
        return max(steps, default=None)

    def _release_memory(self, done: bool) -> None:
        root = self.layout.memory
        if root is None:
            return
        if not root.exists():  # no save reached memory: only the job's dir was made
            with contextlib.suppress(OSError):
                root.parent.rmdir()  # if empty (another node's tier may be in it)
            return
        mine = self._newest_in(t for t in self.tiers if t.name == "memory")
        elsewhere = self._newest_in(t for t in self.tiers if t.name != "memory")
        if not done or (mine is not None and (elsewhere is None or elsewhere < mine)):
            warnings.warn(
                f"kept the memory tier {root}: its newest step ({mine}) is in no other tier"
                " yet; remove it by hand once that step is safe elsewhere",
                stacklevel=3,
            )
            return
        shutil.rmtree(root, ignore_errors=True)
        with contextlib.suppress(OSError):
            root.parent.rmdir()  # the job's dir, once its last node's tier is gone

    def progress(self) -> Progress:
        """Committed step per tier, the copy in progress (bytes, rate), errors. Thread-safe."""
        return self._pipe.progress()

    def step_time_s(self) -> float | None:
        """Median seconds per step measured between :meth:`due` calls (None before 2 calls)."""
        return self._costs.steps.value()

    @property
    def preempted(self) -> bool:
        """True once this job's preemption notice has come (see :func:`trainpod.preempted`):
        save now, :meth:`wait`, and exit. This rank's view; for every rank to stop at the
        same step, ask ``trainpod.preempted(sync=True)`` on all of them."""
        return notice.watcher().preempted()

    @property
    def interval_steps(self) -> int | None:
        """The current save interval in steps: ``every``, or the agreed automatic one."""
        return self.every if self.every is not None else self._agreed_interval()

    def interval_s(self) -> float | None:
        """The automatic interval in seconds for the agreed costs (None before a save)."""
        agreed = self._pipe.agreed
        return None if agreed is None else auto_interval_s(agreed, self.bounds)

    @property
    def costs(self) -> Costs | None:
        """The costs all ranks agreed on at the last save (None before one, or with
        ``every``)."""
        return self._pipe.agreed

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Leaving on an exception: a restart is likely, and the memory tier is its fastest
        # source, so it is kept (a clean exit releases it outside trainpod).
        self.close(release_memory=False if exc_type is not None else None)

    # ------------------------------------------------------------------ internals
    def _bind(
        self, link: AgentLink | None, *, required: bool, inherit: Pipeline | None = None
    ) -> None:
        """Process groups, rank facts and threads for the current default process group
        (what ``inherit``, the previous group's, had committed carries over). Collective:
        two ``new_group`` calls and an all-gather."""
        self._write_coll = Coll.create(self._timeout_s)
        self._copy_coll = Coll.create(self._timeout_s)
        if self._write_coll.group is None:  # DCP warns on every single-process call
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        gathered = self._write_coll.all_gather(
            (self.layout.node, link is not None, self.layout.nodes)
        )
        nodes = [g[0] for g in gathered]
        if not all(g[1] for g in gathered):  # every rank hands off, or none does
            if required and link is not None:
                raise CheckpointConfigError("agent=True, but another rank has no agent")
            link = None
        rank = self._write_coll.rank
        ring = node_ring(nodes, gathered[0][2])
        self.ctx = Ctx(
            rank=rank,
            world_size=self._write_coll.world_size,
            node=self.layout.node,
            nodes=ring,
            leader=rank == min(r for r, n in enumerate(nodes) if n == self.layout.node),
            job=self.layout.job_key,
            attempt=self.layout.attempt,
        )
        if link is None:
            self.agent = None
        elif self.agent is None or self.agent.link is not link:
            self.agent = AgentPersistence(
                link,
                job_key=self.layout.job_key,
                node=self.layout.node,
                config=self._config,
                job_id=env_int("TRAINPOD_JOB_ID"),
                attempt_id=env_int("TRAINPOD_ATTEMPT_ID"),
                retry_base_s=self._retry_base_s,
            )
        self._pipe = Pipeline(
            self.ctx,
            self._write_coll,
            self._copy_coll,
            self._primary,
            self.tiers[1:],
            self.meter,
            report=self._report,
            on_event=self._on_event,
            retry_base_s=self._retry_base_s,
            agent=self.agent,
            targets=fallbacks(self.tiers),
            blocked=self._old_busy,
            stage_in_files=self._stage_in_files,
        )
        if inherit is not None:
            self._pipe.inherit(inherit)
        self._pipe.start()

    def _agree_schedule(self) -> None:
        """Every rank takes the save schedule of the lowest rank that has one. Ranks that
        carried on through a recovery hold the same (agreed at their saves and due steps);
        a rank started fresh holds none. Collective."""
        mine = (self._saved_step, self._next_due, self._last_step, self._pipe.agreed)
        rows = self._write_coll.all_gather(mine)
        known = [r for r in rows if r[0] is not None or r[1] is not None or r[3] is not None]
        if known:
            self._saved_step, self._next_due, last, self._pipe.agreed = known[0]
            self._last_step = max(self._last_step, last)

    def _old_busy(self, step: int) -> bool:
        """Whether a pipeline of an earlier process group may still write ``step``'s files."""
        return any(p.may_write(step) for p in list(self._abandoned))

    def _agent_link(
        self, agent: bool | None, custom_tiers: bool, config: TierConfig
    ) -> AgentLink | None:
        """The node agent's hand-off socket, when the copies go there (see ``agent``)."""
        if agent is False:
            return None
        link = AgentLink.from_env()
        why = None
        if link is None:
            why = "no TRAINPOD_CKPT_SOCKET in the environment (not under a trainpod agent)"
        elif custom_tiers:
            why = "custom tiers= cannot be handed to the agent"
        else:
            try:
                json.dumps(config.to_dict())
            except (TypeError, ValueError):
                why = "storage_options are not JSON (the agent cannot be given them)"
            else:
                if link.status(self.layout.job_key, self.layout.node) is None:
                    why = f"the agent does not answer on {link.path}"
        if why is None:
            return link
        if agent:
            raise CheckpointConfigError(f"agent=True, but {why}; pass agent=None or False")
        if link is not None:
            log.warning("checkpoint copies run in this process: %s", why)
        return None

    def _mtbf_now(self) -> float:
        value = float(self._mtbf())
        if not value > 0:
            raise CheckpointConfigError(f"the mtbf_s callable returned {value!r}; want > 0 s")
        return value

    def _agreed_interval(self) -> int | None:
        agreed = self._pipe.agreed
        return None if agreed is None else interval_steps(agreed, self.bounds)

    def _report(self, **metrics: float | int | str | bool) -> None:
        beacon.report(self._last_step, **metrics)

    def _report_progress(self, meter: Meter) -> None:
        """Upload progress as beacon metrics, about once a second while copying."""
        self._report(
            checkpoint_upload_step=-1 if meter.step is None else meter.step,
            checkpoint_upload_tier=meter.tier or "",
            checkpoint_upload_bytes=meter.done,
            checkpoint_upload_total=meter.total,
        )
