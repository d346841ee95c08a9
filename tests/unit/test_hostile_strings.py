"""Hostile strings stay inert: quotes, ``$(...)``, backticks, line breaks, ``../``, NUL,
non-UTF-8 bytes and very long values in job names, arguments, env values, partition and node
names and paths. The rendered sbatch script is golden-tested for a few hostile jobs and run
with bash (up to the point where it would call ``srun``), lifecycle scripts are run with
hostile arguments, and a canary file that any of the ``$(touch canary)`` payloads would create
must never exist. A real local cluster does the same for jobs in
tests/integration/test_hostile_strings.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pydantic
import pytest

from trainpod.agent.lifecycle import LifecycleRunner, Script
from trainpod.errors import SpecError
from trainpod.slurm.batch import BatchRequest, render
from trainpod.slurm.cli import Slurm
from trainpod.slurm.ops import SlurmOps, SlurmSite
from trainpod.spec.job import JobSpec

GOLDEN = Path(__file__).parent.parent / "slurm" / "golden"
UPDATE = os.environ.get("TRAINPOD_UPDATE_GOLDEN") == "1"  # rewrite the golden files

PAYLOADS = (
    "$(touch canary)",
    "`touch canary`",
    "'; touch canary; '",
    '"; touch canary; "',
    "x\ntouch canary",
    "a b\t$HOME ${PATH} \\ | & ; < > * ? ~ !",
    "../../../../tmp/x",
)
"""Each would create ``./canary`` (or leave its directory) if it reached a shell unquoted."""

HOSTILE_SITE = SlurmSite(
    cluster="c",
    state_dir=Path("/srv/tp/st'a te $(touch canary) `touch canary`"),
    jobs_dir=Path("/srv/tp/jobs $(touch canary)"),
    groups={"debug": "workers"},
    python="/opt/py 3/bin/python",
    env=(("PATH", "/usr/bin:/bin"), ("SITE_NOTE", "$(touch canary) `touch canary` 'q' \"d\"")),
    notice_signal="USR1",
    notice_lead_s=15,
)
"""A site whose paths and environment hold payloads (a cluster's operator chose them)."""

HOSTILE_JOBS = {
    "name-and-args": JobSpec(
        command=["python", *PAYLOADS[:4]], name="$(touch canary) `x` 'q'", partition="debug"
    ),
    "env-values": JobSpec(
        command=["train.py"], env={f"V{i}": p for i, p in enumerate(PAYLOADS)}, nodes=2, spares=1
    ),
    "log-escape": JobSpec(
        command=["../../x", "--out=../../../../etc/x"], name="../../x", exclude=["node[1-2]"]
    ),
}


@pytest.mark.parametrize("label", sorted(HOSTILE_JOBS))
def test_hostile_jobs_render_the_golden_batch_script_and_running_it_touches_nothing(
    label: str, tmp_path: Path
) -> None:
    spec = HOSTILE_JOBS[label]
    text = SlurmOps(Slurm({}), HOSTILE_SITE).render(5, spec)
    golden = GOLDEN / f"hostile-{label}.sh"
    if UPDATE:
        golden.write_text(text)
    assert text == golden.read_text(), f"the batch script changed; see {golden}"
    # The job's own strings never reach the script: the agents get them from the controller.
    assert spec.command[-1] not in text and (not spec.name or spec.name not in text)
    script = tmp_path / "job.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    # Run it for real: every export, the notice trap and the first echo, which stops the
    # script (set -u: no SLURM_JOB_NODELIST outside an allocation) before any srun.
    run = subprocess.run(
        ["bash", str(script)],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "1"},
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert run.returncode != 0 and "SLURM_JOB_NODELIST" in run.stderr, run.stderr
    assert not (tmp_path / "canary").exists(), run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sh"]


def test_the_site_env_reaches_the_script_verbatim(tmp_path: Path) -> None:
    text = SlurmOps(Slurm({}), HOSTILE_SITE).render(5, HOSTILE_JOBS["env-values"])
    echo = text.replace('echo "trainpod: allocation', 'printf %s "$SITE_NOTE"; exit 0 #', 1)
    script = tmp_path / "job.sh"
    script.write_text(echo)
    run = subprocess.run(
        ["bash", str(script)],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "1"},
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == dict(HOSTILE_SITE.env)["SITE_NOTE"]
    assert not (tmp_path / "canary").exists()


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"dependency": "afterok:1\ntouch canary"}, "--dependency"),
        ({"dependency": "afterok:1;touch canary"}, "--dependency"),
        ({"exclude": ["node1\ntouch canary"]}, "--exclude"),
        ({"exclude": ["$(touch canary)"]}, "--exclude"),
        ({"partition": "debug\ntouch canary"}, "--partition"),
        ({"partition": "../../x"}, "--partition"),
        ({"time_limit": "10\ntouch canary"}, "--time"),
        ({"name": "job\ntouch canary"}, "--name"),
        ({"env": {"A;touch canary": "1"}}, "--env key"),
        ({"env": {"A": "x\x00y"}}, "--env A"),
        ({"command": ["a\x00b"]}, "argument 0"),
        ({"command": ["ok", "\udcff"]}, "argument 1"),  # a non-UTF-8 byte (surrogateescape)
        ({"command": ["x" * 200_000]}, "argument 0"),
        ({"workdir": "/tmp/\udcfe"}, "--workdir"),
    ],
)
def test_hostile_values_that_would_reach_a_shell_or_exec_are_refused_by_name(
    fields: dict[str, object], names: str
) -> None:
    with pytest.raises(pydantic.ValidationError) as refused:
        JobSpec.model_validate({"command": ["train"], **fields})
    message = str(refused.value)
    assert names in message and "Traceback" not in message


def test_the_renderer_refuses_a_line_break_however_it_got_there() -> None:
    req = BatchRequest(
        cluster="c",
        job_id=1,
        nodes=1,
        spares=0,
        partition="debug",
        output="/s/slurm-%j.out",
        agent_argv=("agent",),
        extra=("--account=ml\ntouch canary",),
    )
    with pytest.raises(SpecError, match="control character"):
        render(req)
    with pytest.raises(SpecError, match="not a name"):
        render(BatchRequest(**{**req.__dict__, "extra": (), "env": (("A B", "1"),)}))


def test_lifecycle_scripts_get_hostile_arguments_verbatim_and_log_inside_their_dir(
    tmp_path: Path,
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    script = work / "$(touch canary) `touch canary`.sh"
    script.write_text('for a in "$@"; do printf "<%s>\\n" "$a"; done\n')
    logs = tmp_path / "node" / "lifecycle"
    runner = LifecycleRunner(
        [Script(script, timeout_s=30, args=PAYLOADS)],
        log_dir=logs,
        marker=tmp_path / "node" / "lifecycle.ok",
        env={"NOTE": "$(touch canary)"},
        on_change=lambda: None,
    )
    runner.run()
    [result] = runner.results
    assert result.state == "ok", result.tail
    log = Path(result.log_path)
    assert log.parent == logs  # the script's name cannot lead its log elsewhere
    for payload in PAYLOADS:
        assert f"<{payload}>" in log.read_text()
    assert not any(p.name == "canary" for p in tmp_path.rglob("*"))
