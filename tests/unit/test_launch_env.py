"""The torchrun environment contract of launch orders."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pydantic
import pytest

from trainpod.api.models import LaunchOrder, RankSlot
from trainpod.controller.config import ControllerConfig
from trainpod.controller.launch import attempt_log_dir, launch_order, node_env, rank_log_path
from trainpod.spec.job import JobSpec
from trainpod.testing import make_config

NODES = ["workers-0", "workers-1", "workers-2"]


@pytest.fixture
def cfg(tmp_path: Path) -> ControllerConfig:
    return make_config(tmp_path, groups=[("workers", 3)], cluster="demo", max_restarts=3)


def order(
    cfg: ControllerConfig,
    node_index: int,
    spec: JobSpec | None = None,
    *,
    attempt_number: int = 2,
    restart_reason: str = "",
) -> LaunchOrder:
    return launch_order(
        cfg,
        job_id=7,
        attempt_id=11,
        spec=spec or JobSpec(command=["python", "train.py", "--steps", "5"]),
        attempt_number=attempt_number,
        nodes=NODES,
        node_index=node_index,
        procs_per_node=4,
        master_addr="10.0.0.1",
        master_port=29512,
        restart_reason=restart_reason,
    )


def test_ranks_are_contiguous_per_node(cfg: ControllerConfig) -> None:
    slots = [order(cfg, i).ranks for i in range(3)]
    assert slots[0] == [RankSlot(rank=r, local_rank=r) for r in range(4)]
    assert slots[1] == [RankSlot(rank=4 + i, local_rank=i) for i in range(4)]
    assert [s.rank for s in slots[2]] == [8, 9, 10, 11]
    every = sorted(s.rank for node in slots for s in node)
    assert every == list(range(12))


def test_world_and_node_variables(cfg: ControllerConfig) -> None:
    env = order(cfg, 1).env
    assert env["WORLD_SIZE"] == "12"
    assert env["LOCAL_WORLD_SIZE"] == "4"
    assert env["GROUP_RANK"] == env["NODE_RANK"] == "1"
    assert env["GROUP_WORLD_SIZE"] == "3"
    assert env["ROLE_WORLD_SIZE"] == "12"
    assert env["ROLE_NAME"] == "default"
    assert env["MASTER_ADDR"] == "10.0.0.1"
    assert env["MASTER_PORT"] == "29512"


def test_per_rank_variables_come_from_the_slots_not_the_node_env(cfg: ControllerConfig) -> None:
    env = order(cfg, 0).env
    assert "RANK" not in env
    assert "LOCAL_RANK" not in env


def test_torchelastic_variables(cfg: ControllerConfig) -> None:
    env = order(cfg, 0).env
    assert env["TORCHELASTIC_RUN_ID"] == "demo-job-7"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "1"  # attempt 2 is the first restart
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"  # the cluster's default
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the leader agent hosts it
    held = JobSpec(command=["x"], interactive=True)  # an allocation: no store to host
    assert order(cfg, 0, held).env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    spec = JobSpec(command=["x"], max_restarts=0)
    assert order(cfg, 0, spec).env["TORCHELASTIC_MAX_RESTARTS"] == "0"  # None means default


def test_the_run_id_is_the_same_on_every_node_and_attempt(cfg: ControllerConfig) -> None:
    orders = [order(cfg, i, attempt_number=n) for i in range(3) for n in (1, 2)]
    ids = {o.env["TORCHELASTIC_RUN_ID"] for o in orders}
    assert ids == {"demo-job-7"}


def test_trainpod_variables(cfg: ControllerConfig, tmp_path: Path) -> None:
    spec = JobSpec(command=["python", "/opt/train.py"], name="gpt", user="ada")
    env = order(cfg, 2, spec, restart_reason="node_lost").env
    assert env["TRAINPOD_CLUSTER"] == "demo"
    assert env["TRAINPOD_JOB_ID"] == "7"
    assert env["TRAINPOD_JOB_NAME"] == "gpt"
    assert env["TRAINPOD_ATTEMPT"] == "2"
    assert env["TRAINPOD_RESTART_REASON"] == "node_lost"
    assert env["TRAINPOD_NNODES"] == "3"
    assert env["TRAINPOD_NODES"] == "workers-0,workers-1,workers-2"
    assert env["TRAINPOD_SHARED_DIR"] == str(tmp_path / "shared")
    assert env["TRAINPOD_CHECKPOINT_URI"] == f"file://{tmp_path / 'checkpoints'}/job-7"
    assert env["TRAINPOD_CHECKPOINT_DIR"] == f"{tmp_path / 'checkpoints'}/job-7"
    assert env["TRAINPOD_TENSORBOARD_DIR"] == str(tmp_path / "shared" / "tensorboard" / "job-7")
    assert order(cfg, 0).env["TRAINPOD_JOB_NAME"] == "python train.py"  # the default name


def test_a_remote_checkpoint_uri_has_no_local_dir(cfg: ControllerConfig) -> None:
    s3 = replace(cfg, checkpoint_uri="s3://bucket/ckpt/")
    env = order(s3, 0).env
    assert env["TRAINPOD_CHECKPOINT_URI"] == "s3://bucket/ckpt/job-7"
    assert "TRAINPOD_CHECKPOINT_DIR" not in env


def test_every_value_is_a_string(cfg: ControllerConfig) -> None:
    assert all(isinstance(v, str) for v in order(cfg, 0).env.values())


def test_job_env_is_passed_through_and_may_set_omp_threads(cfg: ControllerConfig) -> None:
    assert order(cfg, 0).env["OMP_NUM_THREADS"] == "1"  # as torchrun does
    spec = JobSpec(command=["x"], env={"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "8"})
    env = order(cfg, 0, spec).env
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["OMP_NUM_THREADS"] == "8"


def test_job_env_cannot_override_contract_variables(cfg: ControllerConfig) -> None:
    # Not rejected by the spec, but the contract still wins.
    clash = {
        "GROUP_WORLD_SIZE": "99",
        "TORCHELASTIC_RESTART_COUNT": "99",
        "TRAINPOD_JOB_ID": "99",
        "TRAINPOD_ATTEMPT": "99",
        "TRAINPOD_CHECKPOINT_URI": "file:///elsewhere",
    }
    env = order(cfg, 1, JobSpec(command=["x"], env=clash)).env
    assert env["GROUP_WORLD_SIZE"] == "3"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert env["TRAINPOD_JOB_ID"] == "7"
    assert env["TRAINPOD_ATTEMPT"] == "2"
    assert env["TRAINPOD_CHECKPOINT_URI"].endswith("/job-7")


@pytest.mark.parametrize(
    "name",
    [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
    ],
)
def test_job_spec_rejects_the_torchrun_variables(name: str) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        JobSpec(command=["x"], env={name: "0", "OK": "1"})
    assert name in str(err.value)
    assert "remove them" in str(err.value)


def test_order_fields(cfg: ControllerConfig, tmp_path: Path) -> None:
    o = order(cfg, 0)
    assert (o.attempt_id, o.job_id, o.attempt_number) == (11, 7, 2)
    assert o.argv == ["python", "train.py", "--steps", "5"]
    assert o.workdir == str(tmp_path / "shared")  # no workdir given: the shared dir
    assert o.log_dir == str(tmp_path / "jobs" / "7" / "attempt-2")
    assert order(cfg, 0, JobSpec(command=["x"], workdir="/src")).workdir == "/src"


def test_log_paths(cfg: ControllerConfig, tmp_path: Path) -> None:
    assert attempt_log_dir(cfg, 3, 1) == tmp_path / "jobs" / "3" / "attempt-1"
    assert rank_log_path(cfg, 3, 1, 5) == tmp_path / "jobs" / "3" / "attempt-1" / "rank-5.log"


def test_node_env_matches_the_order(cfg: ControllerConfig) -> None:
    spec = JobSpec(command=["x"])
    env = node_env(
        cfg,
        job_id=7,
        spec=spec,
        attempt_number=2,
        nodes=NODES,
        node_index=1,
        procs_per_node=4,
        master_addr="10.0.0.1",
        master_port=29512,
    )
    launched = order(cfg, 1, spec).env
    # the order adds the attempt's id: the address of its progress beacons
    assert launched.pop("TRAINPOD_ATTEMPT_ID").isdigit()
    assert env == launched


def test_an_in_process_job_tells_its_ranks(cfg: ControllerConfig) -> None:
    spec = JobSpec(command=["x"], auto_resume=True, recovery="in-process")
    assert order(cfg, 0, spec).env["TRAINPOD_RECOVERY"] == "in-process"
    assert "TRAINPOD_RECOVERY" not in order(cfg, 0).env  # restart: nothing changes
