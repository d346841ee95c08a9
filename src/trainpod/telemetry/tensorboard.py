"""trainpod's own TensorBoard scalars: one log directory per job on the shared dir.

``<shared dir>/tensorboard/job-<id>/`` is the job's TensorBoard logdir, exported to its ranks
as ``TRAINPOD_TENSORBOARD_DIR``; a script's own ``SummaryWriter`` writes there (or under a
subdirectory of it) and its runs show beside trainpod's two (ADR 0021):

* ``trainpod/``: per step, from rank 0's progress beacons, written by the agent of the node
  that runs rank 0 (:class:`StepScalars`): ``metrics/<name>`` for every number the script
  passes to ``trainpod.report`` (``loss`` is ``metrics/loss``), ``trainpod/steps_per_s``,
  ``trainpod/tokens_per_s``, ``trainpod/checkpoint_stall_s``, ``trainpod/attempt``; and at
  the first step of every attempt a ``trainpod/attempts`` text ("attempt 2 resumed at step
  30: crash: ...") after a ``SessionLog.START`` at that step, which makes TensorBoard purge
  the earlier attempt's steps from there on: each step is shown once, from the attempt that
  last ran it.
* ``trainpod-goodput/``: the job's goodput, ETTR, restarts and seconds per goodput bucket,
  written by the controller (:class:`GoodputScalars`); the step is whole seconds since the
  job was submitted (goodput is a share of the wall clock).

Written as TensorBoard's own ``RecordWriter`` writes (not torch's ``SummaryWriter``:
importing torch would cost the agent seconds), with the protos from
``tensorboard.compat.proto``, imported lazily so that the agent and controller start without
paying for them. Each record's two masked CRC32Cs come from ``google-crc32c`` (C), not from
TensorBoard's pure-Python fallback, which took half of a beacon's writing (~100 of ~190 µs
per beacon, profiled): the bytes are the same (``tests/unit/test_tensorboard_writer.py``).
"""

from __future__ import annotations

import math
import re
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorboard.compat.proto.event_pb2 import Event

    from trainpod.telemetry.goodput import GoodputReport

__all__ = [
    "ENV",
    "GOODPUT_RUN",
    "MAX_METRICS",
    "SPECIAL_KEYS",
    "STEPS_RUN",
    "GoodputScalars",
    "StepScalars",
    "tensorboard_dir",
]

ENV = "TRAINPOD_TENSORBOARD_DIR"
STEPS_RUN = "trainpod"
GOODPUT_RUN = "trainpod-goodput"
MAX_METRICS = 64
"""Distinct ``metrics/<name>`` tags kept per attempt; further names are dropped (counted)."""
MAX_TAG = 100
SPECIAL_KEYS = frozenset(
    {
        "checkpoint_step",
        "checkpoint_stall_s",
        "tokens",
        "tokens_total",
        "generation",
        "lost_generation",
        "collective_timeout_s",
    }
)
"""Beacon keys trainpod interprets itself (see :mod:`trainpod.beacon`), not ``metrics/``."""
_BAD_TAG = re.compile(r"[^A-Za-z0-9_.\-/]")


def tensorboard_dir(shared_dir: Path, job_id: int) -> Path:
    """The job's TensorBoard logdir on the shared dir."""
    return Path(shared_dir) / "tensorboard" / f"job-{job_id}"


_MASK_DELTA = 0xA282EAD8


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC32C of ``data`` (rotated right by 15, plus a constant)."""
    import google_crc32c

    crc = int(google_crc32c.value(data))
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, the data's masked CRC."""
    header = struct.pack("<Q", len(data))
    return b"".join(
        (
            header,
            struct.pack("<I", masked_crc32c(header)),
            data,
            struct.pack("<I", masked_crc32c(data)),
        )
    )


def metric_tag(name: str) -> str:
    """``metrics/<name>``, with characters TensorBoard tags should not carry replaced by _."""
    return "metrics/" + _BAD_TAG.sub("_", name)[:MAX_TAG]


def _number(value: object) -> float | None:
    """A metric value TensorBoard can plot (bools as 0/1); None for strings and the rest."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


class _EventFile:
    """One TensorBoard event file, written with TensorBoard's ``RecordWriter``.

    TensorBoard reads a run's files one after the other in name order, so the name starts
    with ``order`` (zero-padded: the attempt number), not the wall time the usual writers put
    there: attempt 2's file sorts after attempt 1's whatever the clocks of the nodes that
    wrote them. The host and pid keep two writers of one attempt (an agent restarted in the
    middle of it) apart."""

    def __init__(self, logdir: Path, order: int, what: str) -> None:
        import os
        import socket

        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{order:010d}.{socket.gethostname()}.{os.getpid()}.{what}"
        self.path = logdir / name
        self._writer = open(self.path, "ab")  # noqa: SIM115  # closed by close()
        e = event_pb2
        self._add(
            e.Event(
                wall_time=time.time(),
                file_version="brain.Event:2",  # SessionLog.START purges (see StepScalars)
                source_metadata=e.SourceMetadata(writer="trainpod"),
            )
        )

    def scalars(self, step: int, wall_time: float, values: Mapping[str, float]) -> None:
        if not values:
            return
        s = self._summary_pb2
        summary = s.Summary(
            value=[s.Summary.Value(tag=t, simple_value=v) for t, v in values.items()]
        )
        self._add(self._event_pb2.Event(wall_time=wall_time, step=step, summary=summary))

    def text(self, step: int, wall_time: float, tag: str, text: str) -> None:
        from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2

        s = self._summary_pb2
        meta = s.SummaryMetadata(plugin_data=s.SummaryMetadata.PluginData(plugin_name="text"))
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[text.encode()],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        )
        value = s.Summary.Value(tag=tag, metadata=meta, tensor=tensor)
        self._add(
            self._event_pb2.Event(wall_time=wall_time, step=step, summary=s.Summary(value=[value]))
        )

    def session_start(self, step: int, wall_time: float) -> None:
        """A ``SessionLog.START`` at ``step``: TensorBoard drops this run's steps >= ``step``
        read so far (a restart from that step)."""
        e = self._event_pb2
        self._add(
            e.Event(
                wall_time=wall_time, step=step, session_log=e.SessionLog(status=e.SessionLog.START)
            )
        )

    def _add(self, event: Event) -> None:
        self._writer.write(record(event.SerializeToString()))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class StepScalars:
    """trainpod's per-step scalars of one attempt, from rank 0's beacons, in the job's
    ``trainpod/`` run (one event file per attempt, named ``...attempt-<n>``).

    :meth:`beacon` is fed every beacon of rank 0 in arrival order. Only steps above the last
    one written are written, so a step appears once per attempt; the first step of the
    attempt is preceded by a ``SessionLog.START`` at that step, so that TensorBoard drops
    what earlier attempts wrote from that step on (the steps this attempt redoes). Not
    thread-safe: one thread feeds it.
    """

    def __init__(
        self, logdir: Path, *, attempt: int, reason: str = "", max_metrics: int = MAX_METRICS
    ) -> None:
        self.attempt = attempt
        self.reason = reason
        self.max_metrics = max_metrics
        self.written = 0
        """Steps written."""
        self.skipped = 0
        """Step reports not written: a step not above the last one written."""
        self.dropped_metrics: set[str] = set()
        """Metric names over ``max_metrics`` (not written)."""
        self._file = _EventFile(Path(logdir) / STEPS_RUN, attempt, f"attempt-{attempt}")
        self._tags: set[str] = set()
        self._tag_of: dict[str, str] = {}  # a beacon's key -> its tag, once seen
        self._last_step: int | None = None
        self._last_t = 0.0
        self._tokens = 0.0  # tokens reported since the last written step

    @property
    def last_step(self) -> int | None:
        return self._last_step

    def beacon(self, step: int | None, t: float, metrics: Mapping[str, Any] | None) -> None:
        """One beacon of rank 0 (``step`` None: a heartbeat, which writes nothing)."""
        if step is None:
            return
        tokens = _number((metrics or {}).get("tokens"))
        if tokens is not None:
            self._tokens += tokens
        last = self._last_step
        if last is not None and step <= last:
            self.skipped += 1
            return
        values: dict[str, float] = {"trainpod/attempt": float(self.attempt)}
        if last is None:
            self._start(step, t)
        elif t > self._last_t:
            dt = t - self._last_t
            values["trainpod/steps_per_s"] = (step - last) / dt
            if self._tokens:
                values["trainpod/tokens_per_s"] = self._tokens / dt
        for key, value in (metrics or {}).items():
            number = _number(value)
            if number is None:
                continue
            if key == "checkpoint_stall_s":
                values["trainpod/checkpoint_stall_s"] = number
            elif key not in SPECIAL_KEYS and (tag := self._metric(key)) is not None:
                values[tag] = number
        self._file.scalars(step, t, values)
        self._last_step, self._last_t, self._tokens = step, t, 0.0
        self.written += 1

    def _start(self, step: int, t: float) -> None:
        self._file.session_start(step, t)
        what = "started" if self.attempt == 1 else "resumed"
        line = f"attempt {self.attempt} {what} at step {step}"
        self._file.text(
            step, t, "trainpod/attempts", f"{line}: {self.reason}" if self.reason else line
        )

    def _metric(self, key: str) -> str | None:
        tag = self._tag_of.get(key)
        if tag is not None:
            return tag
        tag = metric_tag(key)
        if tag not in self._tags:
            if len(self._tags) >= self.max_metrics:
                self.dropped_metrics.add(key)
                return None
            self._tags.add(tag)
        if len(self._tag_of) < 4 * self.max_metrics:  # names that map to a kept tag
            self._tag_of[key] = tag
        return tag

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def goodput_values(report: GoodputReport) -> dict[str, float]:
    """The goodput run's scalars of one report: goodput, ETTR, restarts, seconds per bucket."""
    values = {
        "goodput/goodput": report.goodput,
        "goodput/ettr": report.ettr,
        "goodput/restarts": float(max(0, len(report.attempts) - 1)),
        "goodput/wall_s": report.wall_s,
    }
    values.update({f"goodput/seconds/{k}": v for k, v in report.buckets.items()})
    return {k: v for k, v in values.items() if math.isfinite(v)}


class GoodputScalars:
    """The job's ``trainpod-goodput/`` run: one point per :meth:`write`, at the whole seconds
    since the job was submitted; a second already written is not written again."""

    def __init__(self, logdir: Path) -> None:
        self._file = _EventFile(Path(logdir) / GOODPUT_RUN, int(time.time()), "goodput")
        self._last_step = -1

    def write(self, report: GoodputReport, now: float) -> bool:
        """Write ``report`` (taken at ``now``); False when this second was written already."""
        step = int(max(0.0, now - report.submitted_at))
        if step <= self._last_step:
            return False
        self._file.scalars(step, now, goodput_values(report))
        self._file.flush()
        self._last_step = step
        return True

    def close(self) -> None:
        self._file.close()
