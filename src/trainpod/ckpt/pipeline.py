"""The background half of a Checkpointer: two threads, each with its own Gloo group.

* writer: for each snapshot, in submission order: ``dcp.save`` of the staged state into the
  primary tier (node-local shared memory; when it is full or unwritable, the next node-local
  tier: :mod:`trainpod.ckpt.placing`), hash this rank's files, gather every rank's
  entries, the node leaders write ``.metadata`` and the manifest, and a final all-gather
  decides: committed everywhere, or discarded everywhere. Then the staging buffers are free.
* copier: takes the newest locally committed step and copies it tier by tier (scratch, peer,
  durable); each tier commits with the same two-phase gather. A failed copy to a tier with
  ``retry`` (durable) is retried with exponential backoff, always for the newest step; other
  tiers skip that step and try again with the next one. Training never waits for it.

Under trainpod (``agent`` given) there is no copier: after each commit the node leader
hands the step to the node's agent, whose persister process copies it on (see
:mod:`trainpod.ckpt.persist`), and :meth:`Pipeline.wait` / :meth:`Pipeline.progress` read
what the persister did back from the agent.

Every decision that changes which collectives run next is taken from gathered values, so
all ranks stay in step. Public methods are thread-safe.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainpod.ckpt.coll import Coll
from trainpod.ckpt.handoff import AgentPersistence, PersistStatus
from trainpod.ckpt.inplace import FramedFile, FramedSource, framed_name, salvage
from trainpod.ckpt.interval import Costs
from trainpod.ckpt.manifest import (
    MANIFEST,
    METADATA,
    FileEntry,
    Manifest,
    digest_of,
    entries,
    rank_files,
    write_atomic,
)
from trainpod.ckpt.placing import Placed, place
from trainpod.ckpt.records import Ctx, EventHook, Progress, Snapshot
from trainpod.ckpt.skips import SkipTally
from trainpod.ckpt.tiers import FsTier, Meter, Tier
from trainpod.ckpt.writefs import PREPARED, Preparer

log = logging.getLogger(__name__)

SALVAGE_WAIT_S = 1.0
"""How long a rank that is not its node's leader waits, on its preparer's thread, for the
leader's prune to salvage its file of the step leaving the memory tier (ADR 0055)."""


def _let_go(framed: FramedFile | None) -> None:
    """Drop a snapshot's framed file: it is in the step's directory (the step's now), or it
    was not used and goes."""
    if framed is None:
        return
    framed.release()
    if framed.path.parent.name == PREPARED:
        try:
            framed.path.unlink()
        except OSError:
            pass


class Pipeline:
    """Owns the writer and copier threads. Call :meth:`start` once, :meth:`close` at the end."""

    def __init__(
        self,
        ctx: Ctx,
        write_coll: Coll,
        copy_coll: Coll,
        primary: FsTier,
        copies: list[Tier],
        meter: Meter,
        *,
        report: Callable[..., None],
        on_event: EventHook | None = None,
        retry_base_s: float = 1.0,
        retry_max_s: float = 60.0,
        agent: AgentPersistence | None = None,
        targets: list[FsTier] | None = None,
        blocked: Callable[[int], bool] | None = None,
        stage_in_files: bool = True,
    ) -> None:
        """With ``agent``, ``copies`` are the tiers the agent's persister fills (for
        :meth:`progress`); this process copies nothing. ``targets``: the tiers a step may be
        written into, fastest first (default: the primary alone; see
        :mod:`trainpod.ckpt.placing`). ``blocked(step)``: true while an abandoned pipeline of
        this rank may still write that step's files (:meth:`abandon`, :meth:`may_write`); a
        snapshot is skipped on every rank while it is true on any, so two generations never
        write one step's files at once. ``stage_in_files``: stage into the primary tier's
        framed files where it prepares files (ADR 0053; :attr:`framed`)."""
        self.ctx, self.cw, self.cc = ctx, write_coll, copy_coll
        self.agent = agent
        self.agent_tiers = [t.name for t in copies] if agent is not None else []
        if agent is not None:
            copies = []
        self.primary, self.copies, self.meter = primary, copies, meter
        self.targets = targets or [primary]
        self._sources: dict[int, FsTier] = {}
        """step -> the tier it was written into, where not the primary."""
        self._report, self._hook = report, on_event
        self._blocked = blocked or (lambda step: False)
        self.retry_base_s, self.retry_max_s = retry_base_s, retry_max_s
        self.staging_free = threading.Event()
        self.staging_free.set()
        self.agreed: Costs | None = None
        """The costs all ranks agreed on at the last snapshot (:meth:`Costs.merge`)."""
        self._write_times: list[float] = []
        self._q: queue.Queue[Snapshot | None] = queue.Queue()
        self._cond = threading.Condition()
        self._inflight = 0
        self._latest_local: int | None = None
        self._highest: int | None = None
        """The highest step this pipeline was given or inherited: its threads never write
        the files of a later one."""
        self._copied_through: int | None = None
        self._attempted: int | None = None
        self._retry_at: float | None = None
        self._failures = 0
        self._pinned: set[int] = set()
        self._manifests: dict[int, Manifest] = {}
        self._committed: dict[str, int | None] = {
            t.name: None for t in [primary, *self.targets, *copies]
        }
        self._errors: dict[str, str] = {}
        self._skipped: dict[str, int] = {}
        self._skips = SkipTally([t.name for t in copies])
        self._stopping = False
        self._give_up = False
        self.preparer = Preparer()
        prepared = primary.prepared_dir()
        self.framed: FramedSource | None = None
        if stage_in_files and prepared is not None:  # the leader prunes: another rank waits
            self.framed = FramedSource(prepared, ctx.rank, 0.0 if ctx.leader else SALVAGE_WAIT_S)
        """Where :meth:`Stager.stage_framed` takes this rank's framed files from."""
        self._writer = threading.Thread(target=self._write_loop, name="tp-ckpt-write", daemon=True)
        self._copier = threading.Thread(target=self._copy_loop, name="tp-ckpt-copy", daemon=True)

    def start(self) -> None:
        # What the writer thread imports, imported here, on the caller's thread, first:
        # two threads importing torch's modules for the first time at once can see one
        # half made (an AttributeError inside torch's own import was seen once in a test
        # run on a loaded box; the likeliest cause, not proven).
        import torch.distributed.checkpoint
        import torch.distributed.checkpoint.api
        import torch.distributed.checkpoint.filesystem  # noqa: F401

        self._writer.start()
        self._copier.start()

    # ---------------------------------------------------------------- caller side
    def submit(self, snap: Snapshot) -> None:
        """Queue a staged snapshot; the staging buffers stay busy until it is written."""
        self.staging_free.clear()
        with self._cond:
            self._inflight += 1
            self._highest = snap.step if self._highest is None else max(self._highest, snap.step)
        self._q.put(snap)

    def wait(self, timeout_s: float | None = None, *, local_only: bool = False) -> bool:
        """Block until every submitted snapshot is committed locally (its tier pruned) and
        (unless ``local_only``) copied to every tier it will reach. False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not self._idle_locked(local_only):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
            latest = self._latest_local
        # the last commit's pruning, on the preparer's thread (_after_commit)
        if not self.preparer.settle(None if deadline is None else deadline - time.monotonic()):
            return False
        if local_only or self.agent is None or latest is None:
            return True
        return self._wait_agent(self.agent, latest, deadline)

    def _wait_agent(self, agent: AgentPersistence, step: int, deadline: float | None) -> bool:
        """Poll the agent until its persister is done with ``step`` (resending the hand-off
        while the agent has not got it: the agent may have restarted)."""
        pause = 0.02
        while True:
            st = agent.status()
            if st is not None and st.done_through is not None and st.done_through >= step:
                return True
            if self.ctx.leader and st is not None and (st.flagged is None or st.flagged < step):
                agent.resend()  # for every tier: all nodes' leaders do it here
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            time.sleep(pause if left is None else min(pause, left))
            pause = min(0.25, pause * 1.5)

    def close(self, timeout_s: float | None) -> bool:
        """Finish pending work (up to ``timeout_s``), then stop both threads. Collective."""
        # First: once every rank is past the collective below, the node's leader may remove
        # the memory tier, and no file may be allocated in it after that.
        self.preparer.close()
        if self.framed is not None:
            self.framed.close()
        done = self.wait(timeout_s)
        with self._cond:
            self._stopping = True
            self._give_up = not done
            self._cond.notify_all()
        self._q.put(None)
        self._writer.join(timeout_s)
        self._copier.join(timeout_s)
        stopped = not self._writer.is_alive() and not self._copier.is_alive()
        if stopped:
            for tier in self.copies:  # the files kept to be written over (ADR 0056)
                tier.drop_reuse()
        return done and stopped

    def abandon(self, why: str) -> None:
        """Give up without another collective: the process group was re-formed (an
        in-process recovery) and this pipeline's groups belonged to the old one. Snapshots
        not yet taken are dropped; the threads end after what they are doing, which fails
        (a peer is gone) or completes (every peer was alive: a commit made then is whole,
        its parts gathered from every rank). Nothing waits for them: see :meth:`busy`."""
        self.cw.close(why)
        self.cc.close(why)
        self.preparer.close(0)
        if self.framed is not None:
            self.framed.close()
        with self._cond:
            self._stopping = self._give_up = True
            while True:
                try:
                    snap = self._q.get_nowait()
                except queue.Empty:
                    break
                if snap is not None:
                    self._inflight -= 1
                    self._drop_framed(snap)
            self._cond.notify_all()
        self._q.put(None)

    def inherit(self, old: Pipeline) -> None:
        """Start from what ``old`` (abandoned) had committed: a re-formed group changes
        nothing that is on disk. Call before :meth:`start`."""
        with old._cond:
            committed = dict(old._committed)
            latest, copied = old._latest_local, old._copied_through
            agreed = old.agreed
        with self._cond:
            self._committed.update(committed)
            self._latest_local, self._copied_through = latest, copied
            if latest is not None:
                self._highest = latest if self._highest is None else max(self._highest, latest)
            self.agreed = agreed

    def busy(self) -> bool:
        """Whether a thread of this pipeline still runs (after :meth:`abandon`: may write)."""
        return self._writer.is_alive() or self._copier.is_alive()

    def may_write(self, step: int) -> bool:
        """Whether a thread of this pipeline may still write ``step``'s files: it runs, and
        it was given (or inherited) that step or a later one. A re-formed group rolls back
        by at most a checkpoint interval, so its saves are held only until it passes the
        old group's steps, however long an old thread stays blocked."""
        with self._cond:
            highest = self._highest
        return highest is not None and step <= highest and self.busy()

    def progress(self) -> Progress:
        if self.agent is not None:
            return self._agent_progress(self.agent)
        with self._cond:
            retry = None if self._retry_at is None else max(0.0, self._retry_at - time.monotonic())
            return Progress(
                committed=dict(self._committed),
                copying_step=self.meter.step,
                copying_tier=self.meter.tier,
                bytes_done=self.meter.done,
                bytes_total=self.meter.total,
                rate_bps=self.meter.rate_bps(),
                pending_snapshots=self._inflight,
                errors=dict(self._errors),
                retry_in_s=retry,
                steps_skipped=dict(self._skips.totals),
            )

    def _agent_progress(self, agent: AgentPersistence) -> Progress:
        st = agent.status()
        with self._cond:
            committed = dict(self._committed)
            errors = dict(self._errors)
            pending = self._inflight
        if st is None:
            errors["agent"] = f"the node's agent does not answer on {agent.link.path}"
            st = PersistStatus()
        for name in self.agent_tiers:
            committed[name] = st.committed.get(name)
        errors.update(st.errors)
        return Progress(
            committed=committed,
            copying_step=st.copying_step,
            copying_tier=st.copying_tier,
            bytes_done=st.bytes_done,
            bytes_total=st.bytes_total,
            rate_bps=st.rate_bps,
            pending_snapshots=pending,
            errors=errors,
            retry_in_s=st.retry_in_s,
            steps_skipped=dict(st.steps_skipped),
        )

    def take_write_times(self) -> list[float]:
        """Seconds from each ``submit`` to its memory-tier commit since the last call."""
        with self._cond:
            out, self._write_times = self._write_times, []
        return out

    def _idle_locked(self, local_only: bool) -> bool:
        if self._inflight:
            return False
        if local_only or not self.copies or self._latest_local is None:
            return True
        return self._copied_through is not None and self._copied_through >= self._latest_local

    def _event(self, name: str, step: int) -> None:
        if self._hook is not None:
            self._hook(name, step)

    # ---------------------------------------------------------------- writer thread
    def _write_loop(self) -> None:
        while (snap := self._q.get()) is not None:
            try:
                self._write(snap)
            except Exception as exc:  # a bug here must not kill the thread silently
                if self.cw.closed is None:
                    log.exception("rank %d: checkpoint of step %d failed", self.ctx.rank, snap.step)
                else:  # abandoned: its group is gone, as expected
                    log.warning(
                        "rank %d: checkpoint of step %d given up (%s): %s",
                        self.ctx.rank,
                        snap.step,
                        self.cw.closed,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                    )
                self.staging_free.set()
            finally:
                snap.staged = {}
                self._drop_framed(snap)  # unless the write took it (or failed with it)
                with self._cond:
                    self._inflight -= 1
                    self._cond.notify_all()

    def _write(self, snap: Snapshot) -> None:
        ctx, step = self.ctx, snap.step
        pre = self.cw.all_gather(
            (snap.proposal, snap.stall_s, ctx.node, snap.nbytes, self._blocked(step))
        )
        stalls = [p[1] for p in pre if p[1] is not None]
        stall = max(stalls) if stalls else None
        props: list[Costs] = [p[0] for p in pre if p[0] is not None]
        if len(props) == len(pre):  # read by save() only after staging_free: same on all ranks
            agreed = props[0]
            for other in props[1:]:
                agreed = agreed.merge(other)
            self.agreed = agreed
        busy = [r for r, p in enumerate(pre) if p[4]]
        if busy:
            snap.staged = {}
            self._drop_framed(snap)
            self.staging_free.set()
            why = (
                f"step {step} skipped: a thread of the process group before an in-process "
                f"recovery may still write it on rank {', '.join(map(str, busy))}"
            )
            log.warning("rank %d: %s", ctx.rank, why)
            self._event("skipped", step)
            self._report(checkpoint_skipped_step=step)
            return
        needed = sum(p[3] for p in pre if p[2] == ctx.node)
        placed = place(ctx, self.cw, self.targets, step, snap.staged, needed, snap.framed)
        tier = placed.tier
        d = Path(tier.step_dir(step))
        err = placed.error
        if snap.framed is None:
            snap.staged = {}
        # else the snapshot's views of its framed file stay until the step is committed
        # (_write_loop drops them): unmapping 1.2 GB took 0.1 s, before the commit (measured)
        self._learn(placed)
        self.staging_free.set()
        self._tier_full(step, placed)  # may ask the agent: after the staging is free
        mine: list[FileEntry] = []
        meta: bytes | None = None
        if err is None:
            self._event("written", step)
            try:
                mine = entries(
                    d,
                    rank_files(d, ctx.rank),
                    rank=ctx.rank,
                    node=ctx.node,
                    known=placed.written,
                )
                if ctx.rank == 0:
                    meta = (d / METADATA).read_bytes()
            except OSError as exc:
                err = f"hash: {exc}"
        # Which steps go to the durable store is decided here, by all ranks together: a step
        # does when no node's persister is still busy with an earlier one (see persist.py).
        idle = self.agent.global_idle() if self.agent is not None and ctx.leader else True
        parts = self.cw.all_gather((err, mine, meta, ctx.node, time.time(), idle))
        errors = [f"rank {r}: {p[0]}" for r, p in enumerate(parts) if p[0]]
        manifest = None
        if not errors:
            meta = parts[0][2]
            assert meta is not None
            files = [e for p in parts for e in p[1]]
            files.append(FileEntry(METADATA, len(meta), digest_of(meta), None, parts[0][3]))
            # One creation time (rank 0's): every node's manifest has the same bytes, which
            # the agents' decentralised durable commit relies on.
            manifest = Manifest(
                step, ctx.world_size, ctx.nodes, tuple(files), ctx.job, ctx.attempt, parts[0][4]
            )
            if ctx.leader:
                try:
                    if ctx.rank != 0:
                        write_atomic(d / METADATA, meta, sync=tier.sync)
                    tier.commit(step, manifest)
                except OSError as exc:
                    err = f"manifest: {exc}"
        commit_errs = [f"rank {r}: {e}" for r, e in enumerate(self.cw.all_gather(err)) if e]
        errors = errors or commit_errs
        if errors or manifest is None:
            self._failed(tier, step, errors, discard=True)
            return
        if self.agent is not None and ctx.leader:  # before anything that may end this process
            durable = all(p[5] for p in parts)
            source = None if tier is self.primary else tier.name
            if self.agent.handoff(step, stall, manifest.total_bytes(), durable, source=source):
                with self._cond:
                    self._errors.pop("agent", None)
            else:  # wait() resends it; the next commit supersedes it
                log.warning("rank %d: the agent did not take step %d (yet)", ctx.rank, step)
                why = f"step {step}: hand-off to {self.agent.link.path} failed"
                with self._cond:
                    self._errors["agent"] = why
        with self._cond:
            self._write_times.append(time.monotonic() - snap.submitted)
            self._skips.offered(step)
            self._manifests[step] = manifest
            self._latest_local = step
            self._committed[tier.name] = step
            self._errors.pop(tier.name, None)
            if tier is not self.primary:
                self._sources[step] = tier
            for old in [s for s in self._sources if s < step and s not in self._pinned]:
                del self._sources[old]
            for old in [s for s in self._manifests if s < step and s not in self._pinned]:
                del self._manifests[old]
            protect = set(self._pinned)
            self._cond.notify_all()
        self._committed_event(tier, step, written=True)
        self._after_commit(tier, protect | {step}, snap, mine)

    def _after_commit(
        self, tier: FsTier, protect: set[int], snap: Snapshot, mine: list[FileEntry]
    ) -> None:
        """Prune the tier (the leader) and let the snapshot's framed file go, then prepare
        the next step's files: all on the preparer's thread, at its low priority, when it
        prepares; else here. Freeing the last step's pages (unlinking it: 0.15-0.2 s for
        1.2 GB) and unmapping the snapshot (0.1 s) took the CPU at the training loop's
        priority (measured). The tier's methods hold no state between calls: a prune there
        beside the next save's write here touches other steps (it leaves steps newer than
        the newest committed one alone)."""
        staged, framed = snap.staged, snap.framed
        snap.staged, snap.framed = {}, None
        leader, rank = self.ctx.leader, self.ctx.rank
        salvage = self._salvage(tier)
        source = self.framed if salvage is not None else None

        def housekeeping() -> None:
            nonlocal staged, framed
            if leader:
                try:
                    tier.prune(tier.keep, protect, salvage)
                except OSError as exc:
                    log.warning("rank %d: pruning %s: %s", rank, tier.name, exc)
            staged = {}
            if source is not None and framed is not None and framed.path.parent.name != PREPARED:
                source.retire(framed, tier.keep + 1)  # in its step now: mapped till salvaged
            else:
                _let_go(framed)
            framed = None

        if not self._prepare(tier, mine, housekeeping):
            housekeeping()

    def _prepare(
        self, tier: FsTier, mine: list[FileEntry], first: Callable[[], object] | None = None
    ) -> bool:
        """Allocate this rank's files for the next step in the tier just written (if it
        preallocates: :mod:`trainpod.ckpt.writefs`), and the framed file the next save is
        to stage into (:mod:`trainpod.ckpt.inplace`), unless a snapshot already waits;
        ``first`` before them. False when nothing was asked of the preparer."""
        prepared = tier.prepared_dir()
        if prepared is None or not self._q.empty():
            return False
        source = self.framed if tier is self.primary else None
        then = source.make if source is not None and source.wanted() else None
        skip = framed_name(self.ctx.rank)
        sizes = {e.name: e.size for e in mine if e.name != skip}
        self.preparer.request(prepared, sizes, then, first)
        return True

    def _salvage(self, tier: FsTier) -> Callable[[Path], object] | None:
        """What a prune of ``tier`` does with a leaving step's framed files: moves them into
        ``.prepared`` to be written over by the next saves (ADR 0055), when its ranks
        stage into files there."""
        prepared = tier.prepared_dir()
        if tier is not self.primary or self.framed is None or prepared is None:
            return None
        return functools.partial(salvage, prepared=prepared)

    @staticmethod
    def _drop_framed(snap: Snapshot) -> None:
        """The writer is done with the snapshot's framed file."""
        framed, snap.framed = snap.framed, None
        _let_go(framed)

    def _learn(self, placed: Placed) -> None:
        """Staging into files stops for good when DCP leaves some of this rank's tensors to
        another rank (it writes a replicated tensor once): a framed file of them all would
        hold copies nobody reads."""
        staged, planned = placed.tensors
        if self.framed is None or placed.error is not None or planned >= staged:
            return
        if self.framed.off is None:
            why = (
                f"DCP writes {planned} of the {staged} tensors rank {self.ctx.rank} stages (it"
                " writes each replicated tensor on one rank only); staging into the memory"
                " tier's files is off for this run: they would hold every rank's copy"
            )
            log.info("rank %d: %s", self.ctx.rank, why)
            self.framed.turn_off(why)

    def _committed_event(
        self, tier: Tier, step: int, skipped: int = 0, *, written: bool = False
    ) -> None:
        """``written``: the writer's commit (the primary's, or a fallback's)."""
        self._event(f"committed:{tier.name}", step)
        metrics: dict[str, Any] = {f"checkpoint_{tier.name}_step": step}
        if not written:
            metrics[f"checkpoint_{tier.name}_skipped"] = skipped
        else:
            metrics["checkpoint_step"] = step  # the agent's "steps after it are recomputed"
        self._report(**metrics)

    def _tier_full(self, step: int, placed: Placed) -> None:
        """Say which tiers were full or unwritable for ``step`` and where it went: the log,
        :meth:`progress`'s errors, the hook (``full:<tier>``), a beacon, and the node's
        agent (the controller's ``checkpoint_tier_full`` event)."""
        if not placed.full:
            return
        to = placed.tier.name if placed.error is None else None
        for f in placed.mine(self.ctx.node):
            went = f"written to {to} instead" if to else "no tier took it"
            why = f"step {step}: {f.describe()}; {went}"
            log.warning("rank %d: %s", self.ctx.rank, why)
            with self._cond:
                self._errors[f.tier] = why
            self._event(f"full:{f.tier}", step)
            self._report(checkpoint_full_tier=f.tier, checkpoint_full_to=to or "")
            if self.agent is not None and self.ctx.leader:
                self.agent.tier_full(step, f, to, placed.error)

    def _failed(self, tier: Tier, step: int, errors: list[str], *, discard: bool) -> None:
        why = "; ".join(errors) or "unknown"
        log.warning("rank %d: step %d not committed to %s: %s", self.ctx.rank, step, tier.name, why)
        with self._cond:
            self._errors[tier.name] = f"step {step}: {why}"
        writer = self.ctx.leader if tier.node_scoped else self.ctx.rank == 0
        tier.drop_reuse()  # a full disk gets back the space kept to write over
        if discard and writer:
            try:
                tier.discard(step)
            except Exception as exc:  # the store may be unreachable: a later prune cleans up
                log.info("rank %d: discard %s step %d: %s", self.ctx.rank, tier.name, step, exc)
        self._event(f"failed:{tier.name}", step)
        self._report(checkpoint_failed_tier=tier.name, checkpoint_failed_step=step)

    # ---------------------------------------------------------------- copier thread
    def _pending_locked(self) -> bool:
        latest = self._latest_local
        done = self._copied_through
        return latest is not None and (done is None or latest > done)

    def _ready_locked(self) -> bool:
        latest = self._latest_local
        if latest is None or not self._pending_locked():
            return False
        if self._attempted is None or latest > self._attempted:
            return True
        return self._retry_at is None or time.monotonic() >= self._retry_at

    def _copy_loop(self) -> None:
        if not self.copies:
            return
        try:
            self._copy_rounds()
        except Exception as exc:
            if self.cc.closed is None:
                raise
            log.warning("rank %d: copies given up: %s", self.ctx.rank, exc)

    def _copy_rounds(self) -> None:
        while True:
            with self._cond:
                # Wake for a new step or a due retry; when closing, also once nothing is
                # pending (to agree on stopping) or when close() gave up waiting.
                while not (
                    self._ready_locked()
                    or self._give_up
                    or (self._stopping and not self._pending_locked())
                ):
                    wait = None if self._retry_at is None else self._retry_at - time.monotonic()
                    self._cond.wait(max(0.01, wait) if wait is not None else None)
                cand = self._latest_local if self._ready_locked() else None
                if cand is not None:
                    self._pinned.add(cand)
                stop, give_up = self._stopping, self._give_up
            gathered = self.cc.all_gather((cand, stop, give_up))
            if all(g[2] for g in gathered):
                return  # every rank gave up waiting (close timed out): abandon the copies
            cands = [g[0] for g in gathered if g[0] is not None]
            if not cands:
                if all(g[1] for g in gathered):
                    return
                continue
            self._round(max(cands))

    def _source(self, step: int) -> FsTier:
        """The tier ``step`` was written into (a full primary sent it to a fallback)."""
        with self._cond:
            return self._sources.get(step, self.primary)

    def _manifest(self, step: int) -> Manifest:
        with self._cond:
            m = self._manifests.get(step)
        if m is None:  # committed by the writer of another rank a moment ago: read it back
            m = Manifest.from_json(
                (Path(self._source(step).step_dir(step)) / MANIFEST).read_bytes()
            )
        return m

    def _round(self, step: int) -> None:
        ctx = self.ctx
        with self._cond:
            self._pinned.add(step)
            self._attempted = step
        src = Path(self._source(step).step_dir(step))
        retry = False
        for tier in self.copies:
            with self._cond:
                done = self._committed[tier.name]
            if (done is not None and done >= step) or self._skipped.get(tier.name) == step:
                continue
            writer = ctx.leader if tier.node_scoped else ctx.rank == 0
            err: str | None = None
            try:
                m = self._manifest(step)
                names = [f.name for f in m.files if f.rank == ctx.rank]
                if writer:
                    names.append(METADATA)
                sizes = {f.name: f.size for f in m.files}
                self.meter.start(step, tier.name, sum(sizes[n] for n in names))
                tier.put(step, src, names, self.meter)
            except Exception as exc:  # any store error: OSError, botocore's, fsspec's
                err = f"{type(exc).__name__}: {exc}"
            errors = [f"rank {r}: {e}" for r, e in enumerate(self.cc.all_gather(err)) if e]
            if not errors:
                if writer:
                    try:
                        tier.commit(step, m)
                    except Exception as exc:
                        err = f"manifest: {type(exc).__name__}: {exc}"
                errors = [f"rank {r}: {e}" for r, e in enumerate(self.cc.all_gather(err)) if e]
            if errors:
                self._failed(tier, step, errors, discard=not tier.retry)
                if tier.retry:
                    retry = True
                else:
                    self._skipped[tier.name] = step
                continue
            with self._cond:
                self._committed[tier.name] = step
                self._errors.pop(tier.name, None)
                skipped = self._skips.committed(tier.name, step)
            self._committed_event(tier, step, skipped)
            if writer:
                try:
                    tier.prune(tier.keep, {step}, tier.reuser())
                except Exception as exc:
                    log.warning("rank %d: pruning %s: %s", ctx.rank, tier.name, exc)
        with self._cond:
            if retry:
                self._failures += 1
                backoff = min(self.retry_max_s, self.retry_base_s * 2 ** (self._failures - 1))
                self._retry_at = time.monotonic() + backoff
            else:
                self._failures = 0
                self._retry_at = None
                self._copied_through = step
                self._pinned = {s for s in self._pinned if s > step}
            self.meter.step = self.meter.tier = None
            protect = set(self._pinned)
            if self._latest_local is not None:
                protect.add(self._latest_local)
            self._cond.notify_all()
        if ctx.leader and not retry:  # the writer could not drop what this round was reading
            try:
                self.primary.prune(self.primary.keep, protect, self._salvage(self.primary))
            except OSError as exc:
                log.warning("rank %d: pruning %s: %s", ctx.rank, self.primary.name, exc)
