"""Slurm's pure parts: the batch script, slurm.conf lines, JSON parsing, spec (host lists:
test_hostlist.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from trainpod.errors import SpecError
from trainpod.slurm.batch import BatchRequest, render
from trainpod.slurm.cli import Slurm, parse_job, parse_node
from trainpod.slurm.conf import render_conf
from trainpod.slurm.ops import SlurmOps, SlurmSite
from trainpod.spec.job import JobSpec
from trainpod.spec.loading import parse_cluster_spec


def _request(**kw: object) -> BatchRequest:
    base: dict[str, object] = dict(
        cluster="c",
        job_id=7,
        nodes=2,
        spares=1,
        partition="debug",
        output="/s/jobs/7/slurm-%j.out",
        agent_argv=("/py", "-m", "trainpod.agent.main", "--allocation", "7"),
    )
    base.update(kw)
    return BatchRequest(**base)  # type: ignore[arg-type]


def test_the_batch_script_asks_for_nodes_plus_spares_and_runs_an_agent_per_node(
    tmp_path: Path,
) -> None:
    text = render(_request(time_limit="1:00:00", nice=3, exclude=("node9",), priority=5))
    lines = text.splitlines()
    assert "#SBATCH --nodes=3" in lines and "#SBATCH --no-kill" in lines
    assert "#SBATCH --requeue" in lines and "#SBATCH --exclude=node9" in lines
    assert "#SBATCH --time=1:00:00" in lines and "#SBATCH --nice=3" in lines
    assert "#SBATCH --priority=5" in lines
    assert "export TRAINPOD_ALLOCATION=7" in lines
    assert any("srun --nodes=1 --ntasks=1" in line and "--no-kill" in line for line in lines)
    script = tmp_path / "job.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    assert render(_request()) == render(_request())  # deterministic: golden-testable


def test_arguments_are_shell_quoted() -> None:
    text = render(_request(agent_argv=("/my dir/python", "-c", "print('x')")))
    assert "'/my dir/python' -c 'print('\"'\"'x'\"'\"')'" in text


SPEC = {
    "name": "s",
    "backend": "slurm",
    "instance_groups": [
        {
            "name": "gpu",
            "count": 2,
            "devices_per_node": 8,
            "slurm": {"nodes": "g[1-2]", "cpus": 96, "features": ["h200"]},
        },
        {"name": "cpu", "count": 1, "devices_per_node": 0},
    ],
    "partitions": [{"name": "main", "groups": ["gpu", "cpu"]}, {"name": "gpus", "groups": ["gpu"]}],
}


def test_render_conf_writes_node_and_partition_lines() -> None:
    text = render_conf(
        parse_cluster_spec(SPEC, source="spec", base_dir=Path(".")), health_program="/usr/bin/tp"
    )
    assert "NodeName=g[1-2] CPUs=96 Gres=gpu:8 Feature=h200 State=UNKNOWN" in text
    assert "NodeName=cpu-0 State=UNKNOWN" in text
    assert "PartitionName=main Nodes=cpu-0,g[1-2] Default=YES MaxTime=INFINITE State=UP" in text
    assert "PartitionName=gpus Nodes=g[1-2] Default=NO" in text
    assert "GresTypes=gpu" in text and "HealthCheckProgram=/usr/bin/tp" in text


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"spare": True}, "hot spares are per job"),
        ({"count": 3}, "count is 3 but slurm.nodes names 2 nodes"),
        ({"slurm": {"nodes": "g[2-1]"}}, "not a Slurm host list"),
    ],
)
def test_slurm_specs_are_checked(change: dict[str, object], words: str) -> None:
    spec = {**SPEC, "instance_groups": [{**SPEC["instance_groups"][0], **change}]}  # type: ignore[dict-item]  # SPEC is a dict of objects
    spec["partitions"] = [{"name": "main", "groups": ["gpu"]}]
    with pytest.raises(SpecError, match=words):
        parse_cluster_spec(spec, source="spec", base_dir=Path("."))


def test_sbatch_options_trainpod_sets_are_refused() -> None:
    spec = {**SPEC, "slurm": {"sbatch_options": ["--nodes=4"]}}
    with pytest.raises(SpecError, match="trainpod sets"):
        parse_cluster_spec(spec, source="spec", base_dir=Path("."))
    ok = parse_cluster_spec(
        {**SPEC, "slurm": {"sbatch_options": ["--account=ml"]}}, source="s", base_dir=Path(".")
    )
    assert ok.slurm is not None and ok.slurm.sbatch_options == ("--account=ml",)


def test_a_slurm_section_on_a_local_cluster_is_refused() -> None:
    spec = {**SPEC, "backend": "local", "slurm": {}}
    spec["instance_groups"] = [{"name": "w", "count": 1}]
    spec.pop("partitions")
    with pytest.raises(SpecError, match="only used with `backend: slurm`"):
        parse_cluster_spec(spec, source="spec", base_dir=Path("."))


def test_a_bad_time_limit_names_the_formats() -> None:
    with pytest.raises(ValueError, match="HH:MM:SS"):
        JobSpec(command=["x"], time_limit="2h")
    assert JobSpec(command=["x"], time_limit="1-12:00:00").time_limit == "1-12:00:00"


def test_slurm_json_is_parsed_as_22_05_prints_it() -> None:
    node = parse_node(
        {"name": "node2", "state": "down", "state_flags": ["DRAIN", "NOT_RESPONDING"],
         "reason": "Not responding"}
    )  # fmt: skip
    assert node.down and "DRAIN" in node.flags and node.reason == "Not responding"
    assert not parse_node({"name": "n", "state": "idle", "state_flags": []}).down
    job = parse_job(
        {"job_id": 12, "job_state": "PENDING", "state_reason": "BeginTime", "nodes": "",
         "restart_cnt": 1}
    )  # fmt: skip
    assert (job.id, job.state, job.reason, job.nodes, job.restarts, job.ended) == (
        "12", "PENDING", "BeginTime", (), 1, False,
    )  # fmt: skip
    done = parse_job({"job_id": 3, "job_state": "COMPLETED", "state_reason": "None",
                      "nodes": "node[1-2]"})  # fmt: skip
    assert done.ended and done.nodes == ("node1", "node2") and done.reason == ""


def test_a_preemption_notice_is_asked_of_slurm_and_trapped_in_the_batch_shell(
    tmp_path: Path,
) -> None:
    text = render(_request(notice_signal="USR1", notice_lead_s=20))
    lines = text.splitlines()
    assert "#SBATCH --signal=B:USR1@20" in lines and "#SBATCH --requeue" in lines
    trap = next(line for line in lines if line.startswith("trap "))
    assert trap.endswith(" USR1") and "$TRAINPOD_SLURM_NOTICE" in trap
    notice = next(line for line in lines if "TRAINPOD_SLURM_NOTICE=" in line)
    assert notice.startswith("export TRAINPOD_SLURM_NOTICE=/s/jobs/7")
    assert "${SLURM_RESTART_COUNT:-0}" in notice  # one file per round: never the last one's
    assert (
        lines.index(notice)
        < lines.index(trap)
        < next(i for i, line in enumerate(lines) if line.startswith("  srun "))
    )
    script = tmp_path / "job.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    plain = render(_request()).splitlines()
    assert not any(line.startswith(("trap ", "#SBATCH --signal")) for line in plain)


def test_batch_jobs_ask_for_the_notice_and_salloc_jobs_do_not(tmp_path: Path) -> None:
    site = SlurmSite(
        cluster="c",
        state_dir=tmp_path / "state",
        jobs_dir=tmp_path / "jobs",
        groups={"low": "workers"},
        notice_signal="USR1",
        notice_lead_s=15,
    )
    ops = SlurmOps(Slurm({}), site)
    batch = ops.render(3, JobSpec(command=["train"], nodes=1))
    assert "#SBATCH --signal=B:USR1@15" in batch.splitlines()
    alloc = ops.render(4, JobSpec(command=["train"], nodes=1, interactive=True))
    assert "--signal" not in alloc and "trap " not in alloc  # salloc: no batch shell
