"""The recover message between an agent and its ranks (ADR 0026), and the job's opt-in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from trainpod.elastic import BadRecoverMessage, Recover, RecoverWatch, recover_file, write_recover
from trainpod.spec.job import JobSpec

MSG = Recover(
    generation=1,
    attempt_id=9,
    master_addr="10.0.0.1",
    master_port=29513,
    world_size=4,
    replaced=(3,),
    deadline_s=20.0,
)


def test_a_message_survives_the_wire() -> None:
    assert Recover.from_json(MSG.to_json()) == MSG


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{", "not JSON"),
        ("[1]", "expected an object"),
        ('{"generation": 1}', "missing field 'attempt_id'"),
        (MSG.to_json().replace('"master_port": 29513', '"master_port": "x"'), "wrong type"),
        (MSG.to_json().replace('"master_port": 29513', '"master_port": 70000'), "not a TCP port"),
        (MSG.to_json().replace('"generation": 1', '"generation": 0'), "1 or more"),
        (MSG.to_json().replace('"replaced": [3]', '"replaced": [4]'), "not in a world of 4"),
    ],
)
def test_a_bad_message_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(BadRecoverMessage, match=says):
        Recover.from_json(text)


def test_the_watch_returns_only_newer_generations(tmp_path: Path) -> None:
    path = recover_file(tmp_path / "job-1")
    watch = RecoverWatch(path, generation=0)
    assert watch.poll() is None  # no file yet
    write_recover(path, MSG)
    assert watch.poll() == MSG
    watch.generation = 1
    assert watch.poll() is None  # seen: the same generation again is not news
    newer = Recover(**{**MSG.__dict__, "generation": 2, "master_port": 29514})
    write_recover(path, newer)
    assert watch.poll() == newer
    assert [p.name for p in path.parent.iterdir()] == ["recover.json"]  # no temp file left


def test_the_watch_ignores_a_message_left_by_an_earlier_attempt(tmp_path: Path) -> None:
    # the file outlives its attempt in the job's scratch dir; a full restart's ranks (the
    # next attempt, generation 0 again) must not act on the old generation
    path = recover_file(tmp_path / "job-1")
    write_recover(path, MSG)
    assert RecoverWatch(path, generation=0, attempt_id=MSG.attempt_id + 1).poll() is None
    assert RecoverWatch(path, generation=0, attempt_id=MSG.attempt_id).poll() == MSG


def test_a_rank_outside_an_opted_in_job_watches_nothing() -> None:
    assert RecoverWatch(None).poll() is None


def test_recovery_defaults_to_restart_and_in_process_is_stored() -> None:
    assert JobSpec(command=["x"]).recovery == "restart"
    spec = JobSpec(command=["x"], auto_resume=True, recovery="in-process")
    assert JobSpec.model_validate_json(spec.model_dump_json()).recovery == "in-process"


def test_an_unknown_recovery_mode_names_the_choices() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"use restart .* or in-process"):
        JobSpec.model_validate({"command": ["x"], "auto_resume": True, "recovery": "inprocess"})


def test_in_process_recovery_needs_auto_resume() -> None:
    with pytest.raises(pydantic.ValidationError, match="needs --auto-resume"):
        JobSpec(command=["x"], recovery="in-process")


def test_in_process_recovery_is_not_for_allocations() -> None:
    with pytest.raises(pydantic.ValidationError, match="for batch jobs"):
        JobSpec(command=["x"], auto_resume=True, recovery="in-process", interactive=True)


def test_the_message_file_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "recover.json"
    write_recover(path, MSG)
    first = path.stat().st_ino
    write_recover(path, Recover(**{**MSG.__dict__, "generation": 2}))
    assert path.stat().st_ino != first  # a rename, never a write into the file a rank reads
    assert Recover.from_json(path.read_text()).generation == 2
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--recovery", "hot"], "--recovery 'hot' is not a recovery mode; use restart"),
        (["--recovery", "in-process"], "--recovery in-process needs --auto-resume"),
    ],
)
def test_submit_refuses_a_bad_recovery_before_it_asks_the_cluster(
    args: list[str], says: str, tmp_path: Path
) -> None:
    env = {**os.environ, "TRAINPOD_HOME": str(tmp_path)}  # no cluster there: never reached
    cmd = [sys.executable, "-m", "trainpod.cli.main", "submit", *args, "--", "python", "x.py"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=50)
    assert done.returncode != 0
    assert says in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
