"""The agent's checkpoint persister: one process per job and node, outside the workers.

``python -m trainpod.ckpt.persist --job-key K --node N --staging DIR`` is started by the
node's agent (:mod:`trainpod.agent.persisters`) in a session of its own, so a worker that is
SIGKILLed, or torn down with its process group, does not take the uploads with it. It reads
hand-off requests (JSON lines, see :mod:`trainpod.ckpt.handoff`) on stdin and writes reports
(JSON lines) on stdout; EOF on stdin means "finish the newest step, then exit" (bounded by
``--finish-timeout-s``). It runs at a low CPU priority (``--nice``): the training loop comes
first, and on a GPU node the spare cores do the copying.

What it does with the steps it is given (the newest wins; older ones are skipped):

1. hard-links this node's files of the step out of the shared-memory tier into ``DIR``
   (free on tmpfs), so the worker's retention may drop the step while it is being copied;
2. copies them with the :class:`~trainpod.ckpt.tiers.Tier` classes to the node-scoped tiers
   (scratch, peer: commit = this node's manifest) for every step, and to the global tier
   (durable) for the steps flagged ``durable``. The workers flag a step in the gather that
   commits it, only when no node's persister is busy with the durable store, so every
   node uploads the same steps; ``wait()``/``close()`` and the end of the job flag the
   newest step on every node. A node that holds the whole checkpoint (a one-node job) needs
   nobody to agree: its durable copy takes the newest step whenever it is free. Either way a
   slow tier skips the steps committed while it was busy, and says how many (``skipped`` in
   each committed report, ``steps_skipped`` in the status: :mod:`trainpod.ckpt.skips`).
   Where the node's own disk (scratch) is not the device of peer and durable (a network
   store, throttled to the bandwidth cap), it is copied on a thread of its own beside them,
   each lane with its own meter; the status shows the network lane's copy while there is
   one (:func:`~trainpod.ckpt.fullness.same_device`);
3. durable holds every node's part, so it commits without any collective: each node's
   persister uploads its part, then writes ``parts/<node>.json`` atomically (node, step and
   the SHA-256 of the manifest, which is byte-identical on every node); whoever then sees a
   valid marker from every node that owns files writes ``manifest.json`` (the same bytes:
   concurrent writers are harmless) and prunes durable retention. A node that finishes first
   polls until the manifest appears or a newer step arrives, and writes it itself if the
   last writer died between its marker and the manifest.

A failed durable copy is retried with exponential backoff, always for the newest flagged
step; a failed scratch or peer copy is skipped until the next step (the pipeline's semantics).
Reports, one JSON object a line: :class:`PersistReport` (``committed``, ``failed``),
:class:`StatusReport` (``status``, ``exited``) and :class:`Started`; the agent reads them
with :func:`~trainpod.ckpt.persistwire.parse_line` (the wire: :mod:`trainpod.ckpt.persistwire`;
the commit's part markers: :mod:`trainpod.ckpt.parts`). This module imports pydantic: only
the agent and the persister import it, never a worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import fcntl
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainpod.ckpt.errors import CheckpointError, ManifestError
from trainpod.ckpt.filecopy import read_locked
from trainpod.ckpt.fullness import same_device
from trainpod.ckpt.handoff import PersistStatus, TierConfig, build_tiers
from trainpod.ckpt.manifest import MANIFEST, Manifest
from trainpod.ckpt.parts import global_names, is_committed, parts_needed, try_commit, write_part
from trainpod.ckpt.persistwire import (
    PersistReport,
    Request,
    StatusReport,
    parse_request,
)
from trainpod.ckpt.skips import SkipTally
from trainpod.ckpt.tiers import FsTier, Meter, Tier, step_name

log = logging.getLogger(__name__)

DEFAULT_NICE = 19
"""The persister's niceness: the lowest CPU priority. On a busy 2-core machine it costs the
training loop ~1% instead of 8% at 10 (benchmarks/checkpoint.py); on a GPU node the cores the
loop leaves idle do the copying at full speed."""
Emit = Callable[[dict[str, Any]], None]


# -- one node's persister -------------------------------------------------------------------
@dataclass
class _Waiting:
    """A step whose part this node has put into the global tiers; the others' are not in."""

    req: Request
    manifest: Manifest
    next_poll: float
    interval: float


def _newer_attempt(a: Request, b: Request) -> bool:
    return a.attempt_id is not None and b.attempt_id is not None and a.attempt_id > b.attempt_id


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


class Persister:
    """Copies one node's part of the steps it is given to every copy tier. Thread-safe:
    :meth:`offer` and :meth:`finish` from any thread, :meth:`run` (or the rounds) in one.

    Node tiers (scratch, peer) always take the newest step offered. Global tiers (durable)
    take the newest step offered with ``durable=True``: the workers set it, through the
    gather that commits the step, only when every node's persister said it was not busy
    with the global tiers; so every node uploads the same steps and a checkpoint's parts
    meet (nodes that each took "the newest step" at different moments might never upload
    the same one). ``wait()``/``close()`` of the workers, and the end of the job
    (:meth:`finish`), send the newest step with ``durable=True`` on every node.

    ``staging``: where steps are hard-linked while they are copied (None: read in place).
    ``emit``: called with each report (from the thread running the rounds, and with the
    status from :meth:`offer`).
    """

    def __init__(
        self,
        node: str,
        emit: Emit,
        *,
        staging: Path | None = None,
        retry_max_s: float = 60.0,
        poll_s: tuple[float, float] = (0.1, 2.0),
    ) -> None:
        self.node = node
        self.staging = staging
        self._emit = emit
        self.retry_max_s = retry_max_s
        self.poll_s = poll_s
        self.meter = Meter(on_progress=lambda _m: self.emit_status())
        """The copies to peer and durable (throttled to the bandwidth cap)."""
        self.local_meter = Meter(on_progress=lambda _m: self.emit_status())
        """The copy to this node's scratch, beside them (:meth:`_copy_lanes`)."""
        self._cond = threading.Condition()
        self._want: Request | None = None  # newest offered: node tiers
        self._dwant: Request | None = None  # newest offered for the global tiers
        self._node_done: int | None = None
        self._node_tried: int | None = None
        self._global_done: int | None = None
        self._global_tried: int | None = None
        self._running: str | None = None  # "node", "global" or "both" while a round runs
        self._retry_at: float | None = None
        self._failures = 0
        self._waiting: _Waiting | None = None
        self._finishing = False
        self._committed: dict[str, int | None] = {}
        self._errors: dict[str, str] = {}
        self._skipped: dict[str, int] = {}
        self._config: TierConfig | None = None
        self._tiers: list[Tier] = []
        self._skips = SkipTally()
        self._solo = False  # this node holds the whole checkpoint (the last manifest said)

    # -- feeding ------------------------------------------------------------------------
    def offer(self, req: Request) -> None:
        """Persist ``req.step`` (unless a newer step was offered). Idempotent; a request
        with ``durable`` for a step already offered without it adds the global tiers."""
        with self._cond:
            want = self._want
            if want is not None and req.step < want.step and _newer_attempt(req, want):
                self._rollback_locked(req)
            self._skips.offered(req.step)
            if self._want is None or req.step >= self._want.step:
                self._want = req
            # A node that holds the whole checkpoint needs no other node to agree: its global
            # tiers take the newest step whenever they are free, flagged or not.
            durable = req.durable or self._solo
            if durable and (self._dwant is None or req.step >= self._dwant.step):
                self._dwant = req if req.durable else dataclasses.replace(req, durable=True)
            self._cond.notify_all()
        self.emit_status()

    def _rollback_locked(self, req: Request) -> None:
        """A later attempt resumed from an older step and saves again: its steps count,
        even those this persister did for the earlier attempt."""
        log.info("%s: attempt %s restarts at step %d", self.node, req.attempt_id, req.step)
        below = req.step - 1

        def cap(s: int | None) -> int | None:
            return None if s is None or s > below else s

        self._want = self._dwant = None
        self._node_done, self._node_tried = cap(self._node_done), cap(self._node_tried)
        self._global_done, self._global_tried = cap(self._global_done), cap(self._global_tried)
        self._retry_at = self._waiting = None
        self._committed = {t: cap(s) for t, s in self._committed.items()}
        self._skipped.clear()
        self._skips.rollback(req.step)

    def finish(self) -> None:
        """The job ended here: put the newest step into every tier, then let :meth:`run`
        return (every node gets this at the end of the job, so they agree on the step)."""
        with self._cond:
            self._finishing = True
            if self._want is not None and (
                self._dwant is None or self._want.step > self._dwant.step
            ):
                self._dwant = dataclasses.replace(self._want, durable=True)
            self._cond.notify_all()

    # -- status -------------------------------------------------------------------------
    def _has_global(self) -> bool:
        cfg = self._config if self._config is not None else (self._want and self._want.config)
        return bool(cfg and cfg.durable)

    def _done_locked(self) -> int | None:
        """The newest step done in every tier it will reach (node and global)."""
        if self._has_global():
            if self._node_done is None or self._global_done is None:
                return None
            return min(self._node_done, self._global_done)
        return self._node_done

    def status(self) -> PersistStatus:
        with self._cond:
            retry = None if self._retry_at is None else max(0.0, self._retry_at - time.monotonic())
            m = self.meter if self.meter.tier is not None else self.local_meter
            return PersistStatus(
                received=None if self._want is None else self._want.step,
                flagged=None if self._dwant is None else self._dwant.step,
                done_through=self._done_locked(),
                global_busy=self._global_busy_locked(),
                committed=dict(self._committed),
                errors=dict(self._errors),
                copying_step=m.step,
                copying_tier=m.tier,
                bytes_done=m.done,
                bytes_total=m.total,
                rate_bps=m.rate_bps(),
                retry_in_s=retry,
                waiting_step=None if self._waiting is None else self._waiting.req.step,
                pid=os.getpid(),
                steps_skipped=dict(self._skips.totals),
            )

    def emit_status(self) -> None:
        self._emit(dataclasses.asdict(StatusReport("status", self.status())))

    # -- the loop -----------------------------------------------------------------------
    def _node_ready_locked(self) -> bool:
        want, past = self._want, _max(self._node_done, self._node_tried)
        return want is not None and (past is None or want.step > past)

    def _global_pending_locked(self) -> bool:
        d = self._dwant
        return d is not None and (self._global_done is None or d.step > self._global_done)

    def _global_ready_locked(self) -> bool:
        d = self._dwant
        if d is None or not self._global_pending_locked():
            return False
        if self._global_tried is None or d.step > self._global_tried:
            return True
        return self._retry_at is not None and time.monotonic() >= self._retry_at

    def _global_busy_locked(self) -> bool:
        """Copying into the global tiers, or about to: not while only waiting for other
        nodes' parts or for a retry (a new step may then take over, on every node)."""
        return self._running in ("global", "both") or self._global_ready_locked()

    def _own_part_done_locked(self) -> bool:
        """Nothing to do, or only other nodes' parts of the newest global step are missing."""
        if self._node_ready_locked():
            return False
        if not self._global_pending_locked():
            return True
        w, d = self._waiting, self._dwant
        return w is not None and d is not None and w.req.step == d.step

    def run(
        self, finish_timeout_s: float | None = None, stop: threading.Event | None = None
    ) -> None:
        """Rounds until :meth:`finish` was called and this node's part of the newest step is
        done (or, after finish, ``finish_timeout_s`` passed), or until ``stop`` is set. The
        files kept to be written over go then (ADR 0056)."""
        try:
            self._run(finish_timeout_s, stop)
        finally:
            for tier in self._tiers:
                tier.drop_reuse()

    def _run(self, finish_timeout_s: float | None, stop: threading.Event | None) -> None:
        finish_by: float | None = None
        while stop is None or not stop.is_set():
            job: tuple[Request, bool, bool] | None = None
            with self._cond:
                while True:
                    now = time.monotonic()
                    if self._finishing and finish_by is None and finish_timeout_s is not None:
                        finish_by = now + finish_timeout_s
                    if self._finishing and (
                        self._own_part_done_locked() or (finish_by is not None and now >= finish_by)
                    ):
                        return
                    if stop is not None and stop.is_set():
                        return
                    job = self._next_locked()
                    if job is not None:
                        break
                    if self._waiting is not None and now >= self._waiting.next_poll:
                        break
                    due = [t for t in (self._retry_at, finish_by) if t is not None]
                    if self._waiting is not None:
                        due.append(self._waiting.next_poll)
                    wait = min(due) - now if due else None
                    self._cond.wait(max(0.01, wait) if wait is not None else 1.0)
            try:
                if job is not None:
                    self._round(*job)
                else:
                    self.poll_waiting()
            except Exception:  # a bug must not end the uploads: say so, retry with backoff
                log.exception("%s: persisting failed unexpectedly", self.node)
                with self._cond:
                    self._running = None
                    target = job[0] if job else (self._waiting.req if self._waiting else None)
                    self._waiting = None
                if target is not None:
                    self._end_global(target, None, "retry")

    def _next_locked(self) -> tuple[Request, bool, bool] | None:
        """(request, node tiers, global tiers) of the next round, or None."""
        node, glob = self._node_ready_locked(), self._global_ready_locked()
        want, dwant = self._want, self._dwant
        if node and glob and want is not None and dwant is not None and want.step == dwant.step:
            return dwant, True, True
        if glob and dwant is not None:  # other nodes may be waiting for this part
            return dwant, False, True
        if node and want is not None:
            return want, True, False
        return None

    def round(self, req: Request) -> str:
        """Offer ``req`` and run one round for it (tests): node tiers, and global tiers if
        ``req.durable``. Returns the global outcome: "done", "waiting" (this node's part is
        in, others' are not yet), "retry" or "gone" (the step left memory); "done" without
        global tiers."""
        self.offer(req)
        return self._round(req, True, req.durable)

    def _tiers_for(self, cfg: TierConfig) -> list[Tier]:
        if cfg != self._config:
            self._tiers = build_tiers(cfg)
            self._config = cfg
            for t in self._tiers[1:]:
                self._committed.setdefault(t.name, None)
            self._skips.watch([t.name for t in self._tiers[1:]])
        self.meter.bandwidth_bps = cfg.bandwidth_bps
        return self._tiers

    def _report(
        self, req: Request, event: Literal["committed", "failed"], tier: str, **data: Any
    ) -> None:
        report = PersistReport(event, tier, req.step, req.job_id, req.attempt_id, **data)
        self._emit(dataclasses.asdict(report))

    def _stage(self, src: Path, step: int, names: list[str]) -> Path:
        """Hard-link ``names`` of ``src`` into the staging dir (so the worker's retention
        cannot pull them away mid-copy); ``src`` itself where links are impossible.
        Raises FileNotFoundError when the step has left the primary tier."""
        if self.staging is None:
            return src
        for old in self.staging.glob("step-*"):
            shutil.rmtree(old, ignore_errors=True)
        dst = self.staging / step_name(step)
        try:
            dst.mkdir(parents=True, exist_ok=True)  # may fail: the staging's tmpfs is full
            for name in names:
                os.link(src / name, dst / name)
        except OSError as exc:
            shutil.rmtree(dst, ignore_errors=True)
            if exc.errno == errno.ENOENT:
                raise
            log.info("cannot hard-link %s (%s); copying from it in place", src, exc)
            return src
        return dst

    def _round(self, req: Request, node: bool, glob: bool) -> str:
        step = req.step
        with self._cond:
            self._running = "both" if node and glob else "global" if glob else "node"
            if node:
                self._node_tried = _max(self._node_tried, step)
            if glob:
                self._global_tried = step
                if self._waiting is not None and self._waiting.req.step <= step:
                    self._waiting = None
        try:
            return self._copy_round(req, node, glob)
        finally:
            with self._cond:
                self._running = None
                self._cond.notify_all()
            self.emit_status()

    def _copy_round(self, req: Request, node: bool, glob: bool) -> str:
        step = req.step
        try:
            tiers = self._tiers_for(req.config)
            _source(tiers, req.source)
        except CheckpointError as exc:
            with self._cond:
                self._errors["config"] = str(exc)
            self._report(req, "failed", "config", reason=str(exc))
            self._end_node(req, node)
            return self._end_global(req, None, "done" if glob else "")
        primary, copies = _source(tiers, req.source)
        src = Path(primary.step_dir(step))
        todo = [t for t in copies if (t.node_scoped and node) or (not t.node_scoped and glob)]
        if primary is not tiers[0]:  # the worker committed it there itself
            with self._cond:
                self._committed[primary.name] = _max(self._committed.get(primary.name), step)
        reading = ExitStack()
        try:
            m = Manifest.from_json((src / MANIFEST).read_bytes())
            with self._cond:
                self._solo = parts_needed(m) <= {self.node}
            names = [f.name for f in m.files_of(self.node)]
            staged = self._stage(src, step, [*names, MANIFEST])
            if staged == src:  # read in place, by name: held against being written over
                reading.enter_context(read_locked(src / n for n in names))
        except (OSError, ManifestError) as exc:
            self._gone(req, todo, f"step {step} is not in {primary.name}: {exc}")
            self._end_node(req, node)
            return self._end_global(req, None, "gone" if glob else "")
        outcome = "done"
        pending = []
        for tier in todo:
            with self._cond:
                done = self._committed.get(tier.name)
            if (done is not None and done >= step) or self._skipped.get(tier.name) == step:
                continue
            pending.append(tier)
        with reading:
            results = self._copy_lanes(req, m, staged, pending)
        for result in results:
            if result == "retry":
                outcome = "retry"
            elif result == "waiting" and outcome == "done":
                outcome = "waiting"
        if outcome != "retry" and staged != src:
            shutil.rmtree(staged, ignore_errors=True)
        self._end_node(req, node)
        return self._end_global(req, m, outcome if glob else "")

    def _copy_lanes(self, req: Request, m: Manifest, src: Path, tiers: list[Tier]) -> list[str]:
        """Copy into ``tiers``: the node's own disk (unthrottled: scratch) on a thread of
        its own, beside the throttled ones (peer, then durable) on this thread, each lane
        with its own meter, when they are different devices (a real node's NVMe and its
        network store): one after the other, the durable copy waited for the whole scratch
        copy. On one device they go one after the other, the global tier (durable) first:
        two copies at once on one disk make neither sooner and slow the training loop more
        (measured, ADR 0048), and the step is safe from the node's loss one write after the
        memory commit instead of two (the memory tier still serves a restart on this node
        meanwhile; ADR 0051). Results in tier order."""
        local = [t for t in tiers if t.node_scoped and not getattr(t, "throttled", True)]
        remote = [t for t in tiers if t not in local]
        if not local or not remote or any(same_device(a, b) for a in local for b in remote):
            order = [t for t in tiers if not t.node_scoped] + [t for t in tiers if t.node_scoped]
            done = {t.name: self._copy(req, m, src, t, self.meter) for t in order}
            return [done[t.name] for t in tiers]
        got: dict[str, str] = {}
        failure: list[BaseException] = []

        def lane() -> None:
            try:
                for t in local:
                    got[t.name] = self._copy(req, m, src, t, self.local_meter)
            except BaseException as exc:  # re-raised on the round's thread
                failure.append(exc)

        th = threading.Thread(target=lane, name="tp-persist-local", daemon=True)
        th.start()
        try:
            for t in remote:
                got[t.name] = self._copy(req, m, src, t, self.meter)
        finally:
            th.join()
        if failure:
            raise failure[0]
        return [got[t.name] for t in tiers]

    def _copy(self, req: Request, m: Manifest, src: Path, tier: Tier, meter: Meter) -> str:
        """Copy this node's part of ``m`` into ``tier`` and commit what can be committed:
        "done", "waiting" (a global tier lacks other nodes' parts), "retry" or "skipped"."""
        step, node = req.step, self.node
        names = [f.name for f in m.files_of(node)] if tier.node_scoped else global_names(m, node)
        sizes = {f.name: f.size for f in m.files}
        total = sum(sizes[n] for n in names)
        t0 = time.monotonic()
        wrote = False
        try:
            if tier.node_scoped:
                meter.start(step, tier.name, total)
                tier.put(step, src, names, meter)
                tier.commit(step, m)
                done = True
            else:
                assert isinstance(tier, FsTier), "a global tier is an FsTier (it holds markers)"
                done = is_committed(tier, m)
                if not done:
                    meter.start(step, tier.name, total)
                    tier.put(step, src, names, meter)
                    write_part(tier, m, node)
                    done = wrote = try_commit(tier, m)
        except Exception as exc:  # any store error: OSError, botocore's, fsspec's
            why = f"{type(exc).__name__}: {exc}"
            log.warning("%s: step %d not committed to %s: %s", node, step, tier.name, why)
            with self._cond:
                self._errors[tier.name] = f"step {step}: {why}"
            tier.drop_reuse()  # a full disk gets back the space kept to write over
            if not tier.retry:
                self._skipped[tier.name] = step
                try:
                    tier.discard(step)
                except Exception as dexc:  # the store may be unreachable: a prune cleans up
                    log.info("discard %s step %d: %s", tier.name, step, dexc)
            self._report(req, "failed", tier.name, reason=why[:2000], bytes=total)
            self.emit_status()
            return "retry" if tier.retry else "skipped"
        finally:
            meter.step = meter.tier = None
        if not done:
            with self._cond:
                self._errors.pop(tier.name, None)
            return "waiting"
        nbytes = total if tier.node_scoped else m.total_bytes()  # global: the whole checkpoint
        self._committed_now(req, m, tier, nbytes, time.monotonic() - t0, wrote)
        return "done"

    def _committed_now(
        self, req: Request, m: Manifest, tier: Tier, nbytes: int, seconds: float, wrote: bool
    ) -> None:
        with self._cond:
            prev = self._committed.get(tier.name)
            self._committed[tier.name] = max(req.step, prev if prev is not None else req.step)
            self._errors.pop(tier.name, None)
            skipped = self._skips.committed(tier.name, req.step)
        self._report(
            req,
            "committed",
            tier.name,
            bytes=nbytes,
            seconds=seconds,
            since_save_s=max(0.0, time.time() - m.created),
            wrote_manifest=wrote,
            skipped=skipped,
        )
        try:
            tier.prune(tier.keep, {req.step}, tier.reuser())
        except Exception as exc:
            log.warning("pruning %s: %s", tier.name, exc)
        self.emit_status()

    def _gone(self, req: Request, tiers: list[Tier], why: str) -> None:
        with self._cond:
            newer = self._want is not None and self._want.step > req.step
        if newer:
            return  # a newer step covers it
        log.warning("%s: %s", self.node, why)
        for tier in tiers:
            with self._cond:
                done = self._committed.get(tier.name)
                missed = done is None or done < req.step
                if missed:
                    self._errors[tier.name] = why
            if missed:
                self._report(req, "failed", tier.name, reason=why)

    def _end_node(self, req: Request, node: bool) -> None:
        if node:
            with self._cond:
                self._node_done = _max(self._node_done, req.step)

    def _end_global(self, req: Request, m: Manifest | None, outcome: str) -> str:
        """Book the global tiers' outcome of a round ("" when it had none)."""
        with self._cond:
            if outcome == "retry":
                self._failures += 1
                backoff = min(self.retry_max_s, req.retry_base_s * 2 ** (self._failures - 1))
                self._retry_at = time.monotonic() + backoff
            elif outcome:
                self._failures = 0
                self._retry_at = None
                if outcome == "waiting" and m is not None:
                    first = self.poll_s[0]
                    self._waiting = _Waiting(req, m, time.monotonic() + first, first)
                elif outcome in ("done", "gone"):
                    # gone: the step left memory; nothing newer is flagged yet, so the next
                    # step every node flags takes over
                    self._global_done = _max(self._global_done, req.step)
            self._cond.notify_all()
        return outcome or "done"

    def poll_waiting(self) -> bool:
        """Check the global tiers for the commit of the step waiting for other nodes' parts
        (and commit it, if every part is in). True once it is committed everywhere."""
        with self._cond:
            w = self._waiting
        if w is None:
            return False
        committed = True
        for tier in self._tiers[1:]:
            if tier.node_scoped or not isinstance(tier, FsTier):
                continue
            with self._cond:
                done = self._committed.get(tier.name)
            if done is not None and done >= w.req.step:
                continue
            try:
                ok = try_commit(tier, w.manifest)
            except Exception as exc:
                log.info("polling %s for step %d: %s", tier.name, w.req.step, exc)
                ok = False
            if ok:
                self._committed_now(w.req, w.manifest, tier, w.manifest.total_bytes(), 0.0, False)
            committed = committed and ok
        with self._cond:
            if self._waiting is not w:
                return committed
            if committed:
                self._waiting = None
                self._global_done = _max(self._global_done, w.req.step)
            else:
                w.interval = min(self.poll_s[1], w.interval * 2)
                w.next_poll = time.monotonic() + w.interval
            self._cond.notify_all()
        if committed:
            self.emit_status()
        return committed


def _source(tiers: list[Tier], name: str | None) -> tuple[FsTier, list[Tier]]:
    """The tier a step was written into (``name``; None: the primary) and the tiers after
    it, which the copies go to. Raises CheckpointError for a name the tiers do not have."""
    i = 0 if name is None else next((k for k, t in enumerate(tiers) if t.name == name), -1)
    src = tiers[i] if i >= 0 else None
    if not (isinstance(src, FsTier) and src.local and src.node_scoped):
        have = [t.name for t in tiers]
        raise CheckpointError(f"the step's tier {name!r} is not a node-local tier of {have}")
    return src, tiers[i + 1 :]


# -- the process ----------------------------------------------------------------------------
class _Out:
    """JSON lines on stdout. Once the reader is gone (the agent was killed), the reports
    (committed, failed) go to ``journal`` instead, for the next persister of this job and
    node to hand to its agent (:func:`replay`): a step handed over just before the agent
    died is still reported, by the agent that replaced it."""

    def __init__(self, journal: Path | None = None) -> None:
        self._lock = threading.Lock()
        self.broken = False
        self.journal = journal

    def __call__(self, msg: dict[str, Any]) -> None:
        line = json.dumps(msg, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if not self.broken:
                try:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                    return
                except (BrokenPipeError, ValueError, OSError):
                    self.broken = True
            if self.journal is not None and msg.get("event") in ("committed", "failed"):
                try:
                    with self.journal.open("a") as f:
                        f.write(line)
                except OSError as exc:
                    log.warning("cannot keep an undelivered report in %s: %s", self.journal, exc)


def journal_of(staging: Path, node: str) -> Path:
    """Where a persister whose agent died keeps the reports it could not deliver."""
    return staging.parent / f".persist-{node}.undelivered"


def replay(journal: Path, out: Emit) -> int:
    """Hand the reports a predecessor could not deliver to this persister's agent (then
    drop them); how many. Call it holding the job's lock: the predecessor has exited."""
    try:
        lines = journal.read_text().splitlines()
    except OSError:
        return 0
    n = 0
    for line in lines:
        try:
            msg = json.loads(line)
        except ValueError:
            continue  # a line torn by the predecessor's death
        if isinstance(msg, dict):
            out(msg)
            n += 1
    journal.unlink(missing_ok=True)
    if n:
        log.info("handed over %d report(s) a predecessor could not deliver", n)
    return n


def lower_priority(nice: int) -> None:
    """Raise this process's niceness by ``nice``, and its session's autogroup's to match.

    With autogroups (Linux's default for desktops and many servers) the scheduler first
    shares the CPU between sessions, and nice only ranks the tasks of one session: a
    persister in a session of its own (it must be, to outlive the workers' teardown) would
    otherwise get as much CPU as the whole training process, whatever its nice value.
    """
    os.nice(nice)
    try:
        Path("/proc/self/autogroup").write_text(f"{min(19, max(-20, nice))}\n")
    except OSError:
        pass  # no autogroups here (or a kernel without them): plain nice is what counts


def _read_requests(p: Persister, stream: Any) -> None:
    for line in stream:
        try:
            msg = json.loads(line)
            if isinstance(msg, dict) and msg.get("op") == "finish":
                break
            p.offer(parse_request(line))
        except ValueError as exc:
            log.warning("ignored a malformed request: %s", exc)
    p.finish()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="trainpod-persist")
    ap.add_argument("--job-key", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--staging", type=Path, required=True, help="hard-link area (same fs)")
    ap.add_argument("--finish-timeout-s", type=float, default=60.0)
    ap.add_argument("--nice", type=int, default=DEFAULT_NICE, help="CPU niceness increment")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("TRAINPOD_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s [persist {args.job_key}/{args.node}] %(message)s",
    )
    if args.nice:
        lower_priority(args.nice)
    args.staging.mkdir(parents=True, exist_ok=True)
    journal = journal_of(args.staging, args.node)
    out = _Out(journal)
    p = Persister(args.node, out, staging=args.staging)
    reader = threading.Thread(target=_read_requests, args=(p, sys.stdin), daemon=True)
    reader.start()
    # One persister per job and node: a successor (after an agent restart) waits here for
    # its predecessor to finish, so two never write the same part at once.
    with (args.staging.parent / f".persist-{args.node}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        out({"event": "started", "pid": os.getpid()})
        replay(journal, out)
        p.run(finish_timeout_s=args.finish_timeout_s)
    shutil.rmtree(args.staging, ignore_errors=True)
    out(dataclasses.asdict(StatusReport("exited", p.status())))


if __name__ == "__main__":
    main()
