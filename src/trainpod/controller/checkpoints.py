"""Checkpoint reports from agents become events, once each; where uploads stand.

Agents deliver :class:`~trainpod.api.models.CheckpointReport` at least once, so a report may
come twice (a reply lost, a controller restart): each event is keyed and written once.

* ``checkpoint_saved``: a step committed in the memory tier (the save's stall is the longest
  of any rank's), once per job and step;
* ``checkpoint_committed``: once per job, step and tier for tiers that hold the whole
  checkpoint (durable), else once per node too (scratch, peer);
* ``checkpoint_failed``: once per job, step, tier and node;
* ``checkpoint_tier_full``: a tier could not take a step on a node and where it went
  instead, once per job, step, tier and node (docs/decisions/0036).

Everything here runs under the controller's lock, inside its store transaction.
"""

from __future__ import annotations

from typing import Any

from trainpod.api.models import CheckpointReport, CheckpointUpload, Heartbeat
from trainpod.model.events import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointSaved,
    CheckpointTierFull,
    Event,
)
from trainpod.model.states import JobState
from trainpod.store.repo import Store

_LIVE = [s for s in JobState if not s.ended and s is not JobState.QUEUED]
Key = tuple[str, str, str | None, int]  # (kind, tier, node or None, step)


def _key(kind: str, tier: str, node: str | None, step: int) -> Key:
    return (kind, tier, node, step)


def _key_of(event: Event) -> Key | None:
    """The key of a checkpoint event of the log (None for any other event)."""
    if isinstance(event, CheckpointSaved):
        return _key(event.kind, event.tier, None, event.step)  # its node column is None
    if isinstance(event, CheckpointCommitted | CheckpointFailed | CheckpointTierFull):
        return _key(event.kind, event.tier, event.node, event.step)
    return None


class CheckpointEvents:
    def __init__(self) -> None:
        self._seen: dict[int, set[Key]] = {}
        self.uploads: dict[int, dict[str, CheckpointUpload]] = {}
        """job id -> node -> the latest upload status its agent reported."""

    def _seen_of(self, store: Store, job_id: int) -> set[Key]:
        """The job's checkpoint events already written (read once per job and process)."""
        seen = self._seen.get(job_id)
        if seen is None:
            seen = {key for r in store.typed_events(job_id=job_id) if (key := _key_of(r.event))}
            self._seen[job_id] = seen
        return seen

    def record(self, store: Store, hb: Heartbeat, now: float) -> None:
        for rep in hb.checkpoints:
            self._record(store, hb.node, rep, now)
        for up in hb.checkpoint_uploads:
            if store.job(up.job_id) is not None:
                self.uploads.setdefault(up.job_id, {})[hb.node] = up

    def _record(self, store: Store, node: str, rep: CheckpointReport, now: float) -> None:
        job = store.job(rep.job_id)
        if job is None:
            return
        attempts = store.attempts(job.id)
        if not any(node in a.nodes for a in attempts):
            return  # never trust a job id: this node never ran the job
        number = next((a.number for a in attempts if a.id == rep.attempt_id), None)
        # The node column says where the event happened: None for the job as a whole.
        if rep.saved:
            kind, where = "checkpoint_saved", None
        elif rep.full:
            kind, where = CheckpointTierFull.kind, node
        elif rep.ok:
            kind, where = "checkpoint_committed", None if rep.scope == "job" else node
        else:
            kind, where = "checkpoint_failed", node
        key = _key(kind, rep.tier, where, rep.step)
        seen = self._seen_of(store, job.id)
        if key in seen:
            return
        seen.add(key)
        at = rep.at or None
        event: Event
        if rep.full:
            event = CheckpointTierFull(
                job_id=job.id,
                attempt=number,
                node=node,
                at=at,
                step=rep.step,
                tier=rep.tier,
                path=rep.path,
                reason=rep.reason,
                needed_bytes=rep.needed_bytes,
                free_bytes=rep.free_bytes,
                to=rep.to_tier,
            )
        elif rep.saved:
            event = CheckpointSaved(
                job_id=job.id,
                attempt=number,
                at=at,
                step=rep.step,
                tier=rep.tier,
                scope=rep.scope,
                stall_s=rep.stall_s,
                bytes=rep.bytes,
                by=node,
            )
        elif rep.ok:
            whole = rep.scope == "job"
            event = CheckpointCommitted(
                job_id=job.id,
                attempt=number,
                node=where,
                at=at,
                step=rep.step,
                tier=rep.tier,
                scope=rep.scope,
                bytes=rep.bytes,
                seconds=rep.seconds,
                since_save_s=rep.since_save_s,
                by=node if whole else None,
                wrote_manifest=rep.wrote_manifest if whole else None,
                skipped=rep.skipped or None,
            )
        else:
            event = CheckpointFailed(
                job_id=job.id,
                attempt=number,
                node=node,
                at=at,
                step=rep.step,
                tier=rep.tier,
                scope=rep.scope,
                reason=rep.reason,
                bytes=rep.bytes,
            )
        store.append(now, event)

    def progress(self, job_id: int) -> dict[str, Any]:
        """The job's uploads by node, for its live progress (empty when none)."""
        ups = self.uploads.get(job_id, {})
        return {n: u.model_dump(exclude={"job_id"}) for n, u in sorted(ups.items())}

    def keep_only(self, job_ids: set[int]) -> None:
        """Evict what was kept for jobs that have ended (a late report re-reads the store)."""
        for stale in set(self._seen) - job_ids:
            del self._seen[stale]
        for stale in set(self.uploads) - job_ids:
            del self.uploads[stale]


def active_jobs(store: Store, node: str) -> list[int]:
    """Jobs that have not ended and have run (or run) on ``node``: their shared-memory
    checkpoints must stay there (an in-job restart may come back to the node)."""
    return store.live_jobs_on(node, _LIVE)


def active_jobs_by_node(store: Store) -> dict[str, list[int]]:
    """:func:`active_jobs` of every node, in one query (nodes without any left out)."""
    return store.live_jobs_by_node(_LIVE)
