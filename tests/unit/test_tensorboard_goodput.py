"""The controller's goodput run: when the follower writes a job's point, read back with
TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainpod.api.models import AttemptInfo, EventInfo, JobInfo
from trainpod.controller.tensorboard import GoodputFollower
from trainpod.errors import NotFound
from trainpod.model.states import AttemptState, JobState
from trainpod.spec.job import JobSpec
from trainpod.telemetry.tensorboard import GOODPUT_RUN, tensorboard_dir

SUBMITTED = 1000.0


def attempt(number: int, state: AttemptState) -> AttemptInfo:
    ended = None if state == AttemptState.RUNNING else SUBMITTED + 10.0 * number
    return AttemptInfo(
        number=number,
        state=state,
        nodes=["workers-0"],
        master_addr="127.0.0.1",
        master_port=29500,
        created_at=SUBMITTED + 10.0 * (number - 1),
        started_at=SUBMITTED + 10.0 * (number - 1) + 1.0,
        ended_at=ended,
        cause="crash" if state == AttemptState.FAILED else "",
        failure={},
    )


def job(job_id: int, state: JobState, *attempts: AttemptInfo) -> JobInfo:
    return JobInfo(
        id=job_id,
        name="t",
        state=state,
        reason="",
        spec=JobSpec(command=["true"]),
        submitted_at=SUBMITTED,
        started_at=SUBMITTED + 1.0 if attempts else None,
        ended_at=SUBMITTED + 100.0 if state.ended else None,
        attempts=list(attempts),
    )


class World:
    """What the follower reads: the unfinished jobs, any job by id, the clock."""

    def __init__(self) -> None:
        self.now = SUBMITTED
        self.active: list[JobInfo] = []
        self.all: dict[int, JobInfo] = {}

    def get(self, job_id: int) -> JobInfo:
        if job_id not in self.all:
            raise NotFound(f"no job {job_id}")
        return self.all[job_id]

    def follower(self, shared: Path) -> GoodputFollower:
        def events(job_id: int) -> list[EventInfo]:
            return []

        return GoodputFollower(
            shared_dir=shared,
            active_jobs=lambda: self.active,
            job=self.get,
            events=events,
            clock=lambda: self.now,
            period_s=30.0,
        )


def restarts(shared: Path, job_id: int) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(tensorboard_dir(shared, job_id) / GOODPUT_RUN))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("goodput/restarts")]


def test_a_point_per_change_per_period_and_at_the_end(tmp_path: Path) -> None:
    w = World()
    f = w.follower(tmp_path)
    running = job(1, JobState.RUNNING, attempt(1, AttemptState.RUNNING))
    w.active = [running, job(2, JobState.QUEUED)]  # a job that never ran gets no logdir
    w.now = SUBMITTED + 5.2
    assert f.poll() == 1
    w.now += 1.0
    assert f.poll() == 0  # nothing changed
    w.now += 30.0
    assert f.poll() == 1  # the period came
    restarted = job(
        1,
        JobState.RUNNING,
        attempt(1, AttemptState.FAILED),
        attempt(2, AttemptState.RUNNING),
    )
    w.active = [restarted]
    w.now += 2.0
    assert f.poll() == 1  # an attempt changed
    ended = job(
        1,
        JobState.COMPLETED,
        attempt(1, AttemptState.FAILED),
        attempt(2, AttemptState.SUCCEEDED),
    )
    w.active, w.all = [], {1: ended}
    w.now += 2.0
    assert f.poll() == 1  # it ended: the final point
    assert f.poll() == 0  # and no more
    f.close()
    assert restarts(tmp_path, 1) == [(5, 0.0), (36, 0.0), (38, 1.0), (40, 1.0)]
    assert not tensorboard_dir(tmp_path, 2).exists()


def test_a_job_gone_from_the_store_is_dropped_quietly(tmp_path: Path) -> None:
    w = World()
    f = w.follower(tmp_path)
    w.active = [job(3, JobState.RUNNING, attempt(1, AttemptState.RUNNING))]
    w.now = SUBMITTED + 1.0
    assert f.poll() == 1
    w.active = []  # and job() raises NotFound
    w.now += 1.0
    assert f.poll() == 0
    f.close()
    assert restarts(tmp_path, 3) == [(1, 0.0)]
