"""The Megatron-style layout hint: its math, its checks and what the ranks get (ADR 0038)."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainpod.cli.jobs import job_spec, parallelism_of
from trainpod.controller.launch import launch_order
from trainpod.errors import SpecError
from trainpod.spec.job import JobSpec
from trainpod.spec.parallelism import Parallelism, layout
from trainpod.testing import make_config


@st.composite
def fitting(draw: st.DrawFn) -> tuple[int, int, int, int]:
    """(tp, pp, nodes, procs) that make a valid layout."""
    tp = draw(st.integers(1, 8))
    procs = tp * draw(st.integers(1, 4))
    pp = draw(st.integers(1, 6))
    step = tp * pp // math.gcd(procs, tp * pp)  # the fewest nodes whose ranks TP x PP divides
    nodes = step * draw(st.integers(1, 3))
    return tp, pp, nodes, procs


@settings(deadline=None)  # a shared, loaded box: no per-example time limit
@given(fitting())
def test_every_rank_has_one_place_and_a_tp_group_stays_on_its_node(
    case: tuple[int, int, int, int],
) -> None:
    tp, pp, nodes, procs = case
    lay = layout(Parallelism(tensor=tp, pipeline=pp), nodes=nodes, procs_per_node=procs)
    world = nodes * procs
    assert lay.world == world and lay.dp == world // (tp * pp)
    places = [lay.coords(r) for r in range(world)]
    assert len({(c.tp, c.dp, c.pp) for c in places}) == world  # a bijection
    for r, c in enumerate(places):
        assert r == c.pp * lay.dp * tp + c.dp * tp + c.tp  # Megatron's tp-dp-pp order
        group = lay.tp_group(r)
        assert r in group and len(group) == tp
        assert {lay.node_of(g) for g in group} == {lay.node_of(r)}
        assert {lay.coords(g).dp for g in group} == {c.dp}


@settings(deadline=None)  # a shared, loaded box: no per-example time limit
@given(st.data())
def test_a_tp_size_that_does_not_divide_a_nodes_procs_is_refused(data: st.DataObject) -> None:
    tp = data.draw(st.integers(2, 8))
    procs = tp * data.draw(st.integers(0, 3)) + data.draw(st.integers(1, tp - 1))
    with pytest.raises(ValueError) as err:
        layout(Parallelism(tensor=tp), nodes=2, procs_per_node=procs)
    msg = str(err.value)
    assert f"tensor parallel size {tp} does not divide the {procs} processes per node" in msg
    assert "--tensor-parallel one of 1" in msg and f"a multiple of {tp}" in msg


def test_a_world_the_layout_does_not_divide_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"world size 6 \(3 nodes x 2 processes\) is not "):
        layout(Parallelism(tensor=2, pipeline=2), nodes=3, procs_per_node=2)


def test_the_job_spec_checks_the_layout_against_its_shape() -> None:
    JobSpec(command=["x"], nodes=2, procs_per_node=2, parallelism=Parallelism(tensor=2))
    with pytest.raises(pydantic.ValidationError, match="does not divide the 2 processes"):
        JobSpec(command=["x"], nodes=2, procs_per_node=2, parallelism={"tensor": 4})
    with pytest.raises(pydantic.ValidationError, match="greater than or equal to 1"):
        JobSpec(command=["x"], parallelism={"tensor": 0})
    JobSpec(command=["x"], parallelism={"tensor": 8})  # procs unknown: admission checks it


def test_every_size_a_job_may_shrink_to_must_take_the_layout() -> None:
    with pytest.raises(pydantic.ValidationError, match="lets the job shrink to 3 nodes"):
        JobSpec(
            command=["x"],
            nodes=4,
            min_nodes=3,
            procs_per_node=1,
            parallelism={"tensor": 1, "pipeline": 2},
        )


def test_the_ranks_get_the_sizes_and_megatrons_flags(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, groups=[("workers", 2)], cluster="demo")
    spec = JobSpec(command=["python", "pretrain_gpt.py"], parallelism={"tensor": 2})
    env = launch_order(
        cfg,
        job_id=1,
        attempt_id=1,
        spec=spec,
        attempt_number=1,
        nodes=["workers-0", "workers-1"],
        node_index=1,
        procs_per_node=2,
        master_addr="10.0.0.1",
        master_port=29500,
    ).env
    assert (env["TRAINPOD_TP"], env["TRAINPOD_PP"], env["TRAINPOD_DP"]) == ("2", "1", "2")
    assert shlex.split(env["TRAINPOD_PARALLEL_ARGS"]) == [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "1",
    ]
    plain = JobSpec(command=["python", "train.py"])
    env = launch_order(
        cfg,
        job_id=2,
        attempt_id=2,
        spec=plain,
        attempt_number=1,
        nodes=["workers-0"],
        node_index=0,
        procs_per_node=2,
        master_addr="10.0.0.1",
        master_port=29500,
    ).env
    assert not any(k in env for k in ("TRAINPOD_TP", "TRAINPOD_PP", "TRAINPOD_DP"))


def test_the_submit_flags_become_the_spec_and_a_bad_one_names_them() -> None:
    assert parallelism_of(None, None) is None
    assert parallelism_of(2, None) == {"tensor": 2, "pipeline": 1}
    spec = job_spec(command=["x"], nodes=2, procs_per_node=4, parallelism=parallelism_of(2, 2))
    assert spec.parallelism == Parallelism(tensor=2, pipeline=2)
    with pytest.raises(SpecError, match="--tensor-parallel/--pipeline-parallel"):
        job_spec(command=["x"], parallelism=parallelism_of(0, None))


def test_the_launch_orders_put_each_tp_group_on_one_node(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, groups=[("workers", 3)], cluster="demo")
    spec = JobSpec(command=["python", "pretrain_gpt.py"], parallelism={"tensor": 4})
    lay = layout(spec.parallelism or Parallelism(), nodes=3, procs_per_node=8)
    for node_index in range(3):
        slots = launch_order(
            cfg,
            job_id=1,
            attempt_id=1,
            spec=spec,
            attempt_number=1,
            nodes=["workers-0", "workers-1", "workers-2"],
            node_index=node_index,
            procs_per_node=8,
            master_addr="10.0.0.1",
            master_port=29500,
        ).ranks
        here = {s.rank for s in slots}
        assert all(set(lay.tp_group(r)) <= here for r in here)
        assert {lay.node_of(r) for r in here} == {node_index}
