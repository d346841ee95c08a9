"""The controller's goodput run: when the follower writes a job's point, read back with
TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainpod.api.models import AttemptInfo, EventInfo, JobInfo
from trainpod.controller.tensorboard import GoodputFollower
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
    """What the follower reads: the jobs, an event log that names the job of each event (a
    job set here appends one, as every state change does), the clock."""

    def __init__(self) -> None:
        self.now = SUBMITTED
        self.all: dict[int, JobInfo] = {}
        self.log: list[int] = []  # the job of event id i + 1

    def put(self, *jobs: JobInfo) -> None:
        for j in jobs:
            self.all[j.id] = j
            self.log.append(j.id)

    def active(self) -> list[JobInfo]:
        return [j for j in self.all.values() if not j.state.ended]

    def jobs(self, ids: list[int]) -> list[JobInfo]:
        return [self.all[i] for i in ids if i in self.all]

    def changes(self, after: int | None) -> tuple[int, set[int]]:
        return len(self.log), set() if after is None else set(self.log[after:])

    def follower(self, shared: Path) -> GoodputFollower:
        def events(job_id: int) -> list[EventInfo]:
            return []

        return GoodputFollower(
            shared_dir=shared,
            active_jobs=self.active,
            jobs=self.jobs,
            changes=self.changes,
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
    w.put(running, job(2, JobState.QUEUED))  # a job that never ran gets no logdir
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
    w.put(restarted)
    w.now += 2.0
    assert f.poll() == 1  # an attempt changed
    ended = job(
        1,
        JobState.COMPLETED,
        attempt(1, AttemptState.FAILED),
        attempt(2, AttemptState.SUCCEEDED),
    )
    w.put(ended)
    w.now += 2.0
    assert f.poll() == 1  # it ended: the final point
    assert f.poll() == 0  # and no more
    f.close()
    assert restarts(tmp_path, 1) == [(5, 0.0), (36, 0.0), (38, 1.0), (40, 1.0)]
    assert not tensorboard_dir(tmp_path, 2).exists()


def test_a_job_gone_from_the_store_is_dropped_quietly(tmp_path: Path) -> None:
    w = World()
    f = w.follower(tmp_path)
    w.put(job(3, JobState.RUNNING, attempt(1, AttemptState.RUNNING)))
    w.now = SUBMITTED + 1.0
    assert f.poll() == 1
    del w.all[3]  # gone from the store
    w.now += 31.0  # due: asked for, not found, forgotten
    assert f.poll() == 0
    w.now += 31.0
    reads = f.read
    assert f.poll() == 0 and f.read == reads  # and no longer asked for
    f.close()
    assert restarts(tmp_path, 3) == [(1, 0.0)]


def test_a_look_reads_only_the_jobs_that_changed_or_are_due(tmp_path: Path) -> None:
    w = World()
    f = w.follower(tmp_path)
    w.put(*(job(i, JobState.RUNNING, attempt(1, AttemptState.RUNNING)) for i in range(1, 21)))
    w.put(*(job(i, JobState.QUEUED) for i in range(21, 121)))  # a long queue
    w.now = SUBMITTED + 1.0
    assert f.poll() == 20  # the first look lists every unfinished job
    assert f.read == 120
    w.now += 2.0
    assert f.poll() == 0 and f.read == 120  # nothing changed, nothing due: nothing read
    w.put(
        job(7, JobState.RUNNING, attempt(1, AttemptState.FAILED), attempt(2, AttemptState.RUNNING))
    )
    w.put(job(30, JobState.QUEUED))  # changed, but has no attempt: read, not written
    w.now += 2.0
    assert f.poll() == 1 and f.read == 122
    w.now += 30.0
    assert f.poll() == 20 and f.read == 142  # the running ones' period came
    f.close()
