"""trainpod's TensorBoard scalars, written to real event files and read back with
TensorBoard's own reader (``EventAccumulator``, as the Python loader of ``tensorboard`` does)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tb_crc
from tensorboard.summary.writer.record_writer import RecordWriter

from trainpod.agent.tensorboard import TensorBoardTap
from trainpod.api.models import LaunchOrder, RankSlot
from trainpod.telemetry.goodput import BUCKETS, AttemptTimeline, GoodputReport
from trainpod.telemetry.tensorboard import (
    GOODPUT_RUN,
    STEPS_RUN,
    GoodputScalars,
    StepScalars,
    masked_crc32c,
    metric_tag,
    record,
    tensorboard_dir,
)
from trainpod.testing.wait import wait_until


def read(run: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def texts(acc: EventAccumulator, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]


def run_attempt(
    logdir: Path, attempt: int, steps: range, *, t0: float, reason: str = ""
) -> StepScalars:
    w = StepScalars(logdir, attempt=attempt, reason=reason)
    for s in steps:
        w.beacon(s, t0 + s * 0.5, {"loss": attempt * 100 + s, "value": float(s)})
    w.close()
    return w


def test_a_resumed_attempt_replaces_the_steps_it_redoes(tmp_path: Path) -> None:
    run_attempt(tmp_path, 1, range(1, 11), t0=1000.0)
    run_attempt(tmp_path, 2, range(6, 13), t0=2000.0, reason="crash: rank 1 exited")
    acc = read(tmp_path / STEPS_RUN)
    loss = scalars(acc, "metrics/loss")
    assert [s for s, _ in loss] == list(range(1, 13))  # each step once
    assert dict(loss) == {s: (100 + s if s < 6 else 200 + s) for s in range(1, 13)}
    attempt = dict(scalars(acc, "trainpod/attempt"))
    assert attempt == {s: (1.0 if s < 6 else 2.0) for s in range(1, 13)}
    assert texts(acc, "trainpod/attempts") == [
        (1, "attempt 1 started at step 1"),
        (6, "attempt 2 resumed at step 6: crash: rank 1 exited"),
    ]


def test_a_restart_from_scratch_drops_every_earlier_step(tmp_path: Path) -> None:
    run_attempt(tmp_path, 1, range(0, 8), t0=1000.0)
    run_attempt(tmp_path, 2, range(0, 3), t0=2000.0)
    loss = scalars(read(tmp_path / STEPS_RUN), "metrics/loss")
    assert loss == [(0, 200.0), (1, 201.0), (2, 202.0)]


def test_step_rate_tokens_and_stalls_come_from_the_beacons(tmp_path: Path) -> None:
    w = StepScalars(tmp_path, attempt=1)
    w.beacon(10, 100.0, {"tokens": 512})
    w.beacon(None, 100.5, None)  # a heartbeat writes nothing
    w.beacon(12, 101.0, {"tokens": 512})  # reported every other step
    w.beacon(14, 102.0, {"tokens": 1024, "checkpoint_stall_s": 0.25, "checkpoint_step": 14})
    w.close()
    acc = read(tmp_path / STEPS_RUN)
    assert scalars(acc, "trainpod/steps_per_s") == [(12, 2.0), (14, 2.0)]
    assert scalars(acc, "trainpod/tokens_per_s") == [(12, 512.0), (14, 1024.0)]
    assert scalars(acc, "trainpod/checkpoint_stall_s") == [(14, 0.25)]
    tags = set(acc.Tags()["scalars"])
    assert not {"metrics/tokens", "metrics/checkpoint_step", "metrics/checkpoint_stall_s"} & tags


def test_repeated_and_lower_steps_are_not_written_twice(tmp_path: Path) -> None:
    w = StepScalars(tmp_path, attempt=1)
    for step, loss in [(1, 1.0), (2, 2.0), (2, 9.0), (1, 9.0), (3, 3.0)]:
        w.beacon(step, 10.0 + step, {"loss": loss})
    w.close()
    assert (w.written, w.skipped) == (3, 2)
    assert scalars(read(tmp_path / STEPS_RUN), "metrics/loss") == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_metric_names_are_bounded_and_only_numbers_are_plotted(tmp_path: Path) -> None:
    w = StepScalars(tmp_path, attempt=1, max_metrics=2)
    w.beacon(1, 1.0, {"loss": 1.5, "lr": 0.1, "grad norm": 3.0, "phase": "warmup", "ok": True})
    w.beacon(2, 2.0, {"loss": 1.0, "lr": 0.1, "grad norm": 3.0})
    w.close()
    tags = set(read(tmp_path / STEPS_RUN).Tags()["scalars"])
    assert {"metrics/loss", "metrics/lr"} <= tags
    assert w.dropped_metrics == {"grad norm", "ok"}  # over the bound; "phase" is no number
    assert metric_tag("grad norm/é") == "metrics/grad_norm/_"


def test_goodput_is_written_once_per_second_of_the_job(tmp_path: Path) -> None:
    def report(goodput: float, attempts: int) -> GoodputReport:
        buckets = dict.fromkeys(BUCKETS, 0.0)
        buckets["productive"] = 60.0 * goodput
        buckets["restart"] = 60.0 - buckets["productive"]
        return GoodputReport(
            job_id=3,
            state="running",
            submitted_at=1000.0,
            ended_at=None,
            wall_s=60.0,
            buckets=buckets,
            goodput=goodput,
            ettr=goodput,
            lost_by_cause={},
            attempts=[AttemptTimeline(n) for n in range(1, attempts + 1)],
            faults=[],
            notes=[],
        )

    w = GoodputScalars(tmp_path)
    assert w.write(report(0.5, 1), now=1010.2)
    assert not w.write(report(0.6, 1), now=1010.9)  # the same second: not again
    assert w.write(report(0.75, 2), now=1060.0)
    w.close()
    acc = read(tmp_path / GOODPUT_RUN)
    assert scalars(acc, "goodput/goodput") == [(10, 0.5), (60, 0.75)]
    assert scalars(acc, "goodput/restarts") == [(10, 0.0), (60, 1.0)]
    assert scalars(acc, "goodput/seconds/restart") == [(10, 30.0), (60, 15.0)]


def order(tmp_path: Path, attempt_id: int, ranks: list[int], **env: str) -> LaunchOrder:
    return LaunchOrder(
        attempt_id=attempt_id,
        job_id=5,
        attempt_number=attempt_id,
        argv=["true"],
        workdir=str(tmp_path),
        env=env,
        ranks=[RankSlot(rank=r, local_rank=i) for i, r in enumerate(ranks)],
        log_dir=str(tmp_path),
    )


def test_the_agent_writes_rank_zeros_beacons_of_the_attempts_it_watches(tmp_path: Path) -> None:
    logdir = tensorboard_dir(tmp_path, 5)
    env = {"TRAINPOD_TENSORBOARD_DIR": str(logdir), "TRAINPOD_RESTART_REASON": ""}
    tap = TensorBoardTap()
    try:
        assert tap.watch(order(tmp_path, 1, [0, 1], **env))
        assert not tap.watch(order(tmp_path, 2, [2, 3], **env))  # rank 0 runs elsewhere
        assert not tap.watch(order(tmp_path, 3, [0]))  # no logdir
        m: dict[str, Any] = {"loss": 0.5}
        tap.offer([(1, 0, 1, 1.0, m), (1, 1, 1, 1.0, {"loss": 9.0}), (2, 0, 1, 1.0, m)])
        tap.offer([(1, 0, 2, 2.0, {"loss": 0.25}), (9, 0, 1, 1.0, m)])

        def loss() -> list[tuple[int, float]] | None:
            if not (logdir / STEPS_RUN).exists():
                return None
            acc = read(logdir / STEPS_RUN)
            got = scalars(acc, "metrics/loss") if "metrics/loss" in acc.Tags()["scalars"] else []
            return got if len(got) == 2 else None

        assert wait_until(loss, timeout_s=20, what="rank 0's two steps in the logdir") == [
            (1, 0.5),
            (2, 0.25),
        ]
        tap.forget(1)
        tap.offer([(1, 0, 3, 3.0, m)])  # a straggler of the ended attempt: not written
        assert not tap.watch(order(tmp_path, 1, [0, 1], **env))  # its order seen again
    finally:
        tap.close()
    assert scalars(read(logdir / STEPS_RUN), "metrics/loss") == [(1, 0.5), (2, 0.25)]
    assert [p.name.split(".")[-1] for p in (logdir / STEPS_RUN).iterdir()] == ["attempt-1"]


def test_a_full_queue_drops_and_counts(tmp_path: Path) -> None:
    tap = TensorBoardTap(queue_limit=10)
    try:
        tap.watch(order(tmp_path, 1, [0], TRAINPOD_TENSORBOARD_DIR=str(tmp_path)))
        # one batch is queued under one lock: the writer cannot drain it meanwhile
        tap.offer([(1, 0, s, float(s), None) for s in range(1, 1001)])
    finally:
        tap.close()
    assert tap.dropped == 990


def test_an_unwritable_logdir_costs_that_attempt_only(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    good = tmp_path / "good"
    tap = TensorBoardTap()
    try:
        tap.watch(order(tmp_path, 1, [0], TRAINPOD_TENSORBOARD_DIR=str(blocked / "job-1")))
        tap.watch(order(tmp_path, 2, [0], TRAINPOD_TENSORBOARD_DIR=str(good)))
        tap.offer([(1, 0, 1, 1.0, {"loss": 1.0}), (1, 0, 2, 2.0, {"loss": 1.0})])
        tap.offer([(2, 0, 1, 1.0, {"loss": 2.0})])

        def written() -> bool:
            run = good / STEPS_RUN
            return run.is_dir() and "metrics/loss" in read(run).Tags()["scalars"]

        wait_until(written, timeout_s=20, what="attempt 2's step, after attempt 1's failure")
    finally:
        tap.close()
    assert scalars(read(good / STEPS_RUN), "metrics/loss") == [(1, 2.0)]


@settings(deadline=None, max_examples=200)
@given(st.binary(max_size=600))
def test_records_are_tensorboards_own_bytes(data: bytes) -> None:
    """The C CRC32C gives the bytes TensorBoard's own (pure-Python) ``RecordWriter`` writes."""
    assert masked_crc32c(data) == tb_crc(data)
    out = io.BytesIO()
    RecordWriter(out).write(data)
    assert record(data) == out.getvalue()


def losses_on_disk(logdir: Path, n: int) -> list[tuple[int, float]] | None:
    """The steps' losses in ``logdir``'s steps run once there are ``n`` of them, else None."""
    run = logdir / STEPS_RUN
    if not run.is_dir() or "metrics/loss" not in read(run).Tags()["scalars"]:
        return None
    got = scalars(read(run), "metrics/loss")
    return got if len(got) == n else None


def test_the_writer_flushes_within_its_interval_without_another_beacon(tmp_path: Path) -> None:
    tap = TensorBoardTap(flush_every_s=0.2)
    try:
        tap.watch(order(tmp_path, 1, [0], TRAINPOD_TENSORBOARD_DIR=str(tmp_path)))
        tap.offer([(1, 0, s, float(s), {"loss": 1.0 / s}) for s in (1, 2, 3)])

        # nothing more is offered and the file stays open: only the timed flush can do it
        got = wait_until(
            lambda: losses_on_disk(tmp_path, 3), timeout_s=20, what="three steps flushed"
        )
        assert [s for s, _ in got] == [1, 2, 3]
    finally:
        tap.close()


def test_an_attempt_that_ends_before_its_first_write_still_has_its_steps(tmp_path: Path) -> None:
    """A short job's beacons can all be queued when its attempt ends (the writer waits up to
    its interval, longer on a busy node): the end writes them, it does not drop them."""
    tap = TensorBoardTap(flush_every_s=3600.0)  # only the end can write them
    try:
        tap.watch(order(tmp_path, 1, [0], TRAINPOD_TENSORBOARD_DIR=str(tmp_path)))
        tap.offer([(1, 0, s, float(s), {"loss": 1.0 / s}) for s in (1, 2, 3)])
        tap.forget(1)

        got = wait_until(
            lambda: losses_on_disk(tmp_path, 3), timeout_s=20, what="the ended attempt's steps"
        )
        assert [s for s, _ in got] == [1, 2, 3]
        tap.offer([(1, 0, 4, 4.0, {"loss": 0.1})])  # a straggler after the end: not written
    finally:
        tap.close()
    assert [s for s, _ in scalars(read(tmp_path / STEPS_RUN), "metrics/loss")] == [1, 2, 3]
