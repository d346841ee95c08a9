"""Telemetry, computed from events only (never from logs).

Goodput (``compute_goodput``) splits a job's wall clock into these buckets, in seconds:

- queued: submit → attempt 1 created; startup: attempt 1 created → its first beacon.
- productive: each attempt's first → last beacon, less recomputed and checkpoint_stall.
- checkpoint_stall: what the job reports as its loop blocked on checkpoint saves.
- recomputed: steps an earlier attempt had already reached, redone (times the step time),
  plus a failed attempt's last beacon → fault_at (the work lost since the last step).
- in_process: an in-process recovery (ADR 0026) inside an attempt: the fault → the replaced
  ranks running again (``in_process_recovery_done``), taken out of the time around it.
- detection: fault_at → fault_detected; teardown: fault_detected → the attempt's end.
- restart: that end → the next attempt's first rank, less waiting_for_spare (a ``wait``
  recovery decision → the next attempt_created).
- preemption: what a preemption cost: a preempted attempt's last beacon → its end (the
  notice, the grace, the teardown), its end → the next attempt's first rank (the wait in
  the queue), and the steps the next attempt redoes (those after its last checkpoint).
  Never a fault, never ``recomputed`` or ``restart``.
- reload: the next attempt's first rank → its first beacon.
- shutdown: last beacon of the final attempt (its end, after a fault) → job end.
- running_no_beacons: ranks ran but sent no beacons, so nobody can tell productive time.
- unaccounted: what no event explains; the buckets always sum to the wall clock.

goodput = productive / wall; ETTR (Meta) = productive / (wall - queued).
"""

from trainpod.telemetry.goodput import (
    BUCKETS,
    AttemptTimeline,
    FaultRecord,
    GoodputReport,
    compute_goodput,
)

__all__ = ["BUCKETS", "AttemptTimeline", "FaultRecord", "GoodputReport", "compute_goodput"]
