"""Hostile strings on a real local cluster: a job whose name, arguments and env values, and a
lifecycle script whose arguments, hold shell payloads that would create a canary file if
anything ran them through a shell; the canary never appears, the strings arrive verbatim, and
a job named ``../../x`` writes only inside its own log dir (issue 14)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from trainpod.cli.jobs import default_env
from trainpod.spec.job import JobSpec

pytestmark = pytest.mark.integration


def payloads(canary: Path) -> list[str]:
    return [
        f"$(touch {canary})",
        f"`touch {canary}`",
        f"'; touch {canary}; '",
        f'"; touch {canary}; "',
        f"x\ntouch {canary}",
        "a b\t$HOME ${PATH} \\ | & ; < > * ? ~ !",
        "../../../../x",
    ]


LIFECYCLE = 'out="$1"; shift; for a in "$@"; do printf "<%s>\\n" "$a"; done >>"$out"\n'
PRINT_ARGS = (
    "import json, os, sys; "
    "print('ARGS', json.dumps(sys.argv[1:])); "
    "print('ENV', json.dumps({k: v for k, v in os.environ.items() if k.startswith('HOSTILE')}))"
)


def test_hostile_jobs_and_lifecycle_arguments_stay_inert(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    canary = tmp_path / "canary"
    words = payloads(canary)
    script = tmp_path / "setup.sh"
    script.write_text(LIFECYCLE)
    seen = tmp_path / "lifecycle-args.txt"
    lifecycle = json.dumps([{"script": str(script), "args": [str(seen), *words]}])
    c = make_cluster(workers=1, lifecycle=lifecycle)
    assert f"<{words[0]}>" in seen.read_text()  # the lifecycle ran, with every word verbatim
    assert all(f"<{w}>" in seen.read_text() for w in words)

    env = {f"HOSTILE_{i}": w for i, w in enumerate(words)}
    spec = JobSpec(
        command=["python", "-c", PRINT_ARGS, *words],
        name="../../x",
        env={**default_env(), **env},
        workdir=str(c.workdir),
    )
    job = c.client.submit(spec)
    done = c.wait_job(job.id)
    assert done.state == "completed", done.reason
    log = c.client.logs(job.id, rank=0).data
    lines = {
        line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in log.splitlines() if " " in line
    }
    assert json.loads(lines["ARGS"]) == words
    assert json.loads(lines["ENV"]) == env
    assert not canary.exists()
    # Everything the job wrote is inside its own dir; nothing named x appeared anywhere.
    jobs = c.paths.state_dir / "jobs"
    assert {p.relative_to(jobs).parts[0] for p in jobs.iterdir()} == {str(job.id)}
    assert not [p for p in tmp_path.rglob("x") if p.is_file()]
    assert not (jobs.parent.parent / "x").exists() and not (jobs.parent / "x").exists()
