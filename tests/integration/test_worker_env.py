"""Workers get an explicit environment (ADR 0032): the job's own, torchrun's, trainpod's and
the spec's ``env_allow`` of the agent's; nothing else of the shell that ran `cluster create`
reaches them (issue 14: once users share a cluster, one person's shell reached everyone's
jobs). Both ways a rank starts: cold, and forked by the warm-start zygote."""

from __future__ import annotations

import json
import os
import pwd
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from trainpod.cli.jobs import default_env
from trainpod.spec.job import JobSpec

pytestmark = pytest.mark.integration

SHOW_ENV = "import json, os; print('ENV=' + json.dumps(dict(os.environ)), flush=True)\n"

ALLOW = """\
env_allow: [PATH, PYTHONPATH, VIRTUAL_ENV, LANG, LC_*, TZ, TEAM_SITE]
"""


@pytest.mark.timeout(150)
def test_a_variable_of_the_creators_shell_is_absent_and_an_allowed_one_present(
    make_cluster: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LEAKY_SECRET", "creator-only-4d1c")
    monkeypatch.setenv("TEAM_SITE", "eu-west")
    monkeypatch.setenv("HOME", "/nonexistent-creator-home")
    c = make_cluster(workers=2, extra=ALLOW)
    script = tmp_path / "show_env.py"
    script.write_text(SHOW_ENV)
    jobs = {
        how: c.client.submit(
            JobSpec(
                command=["python", str(script)],
                env={**default_env(), "TRAINPOD_WARM_START": flag},
                workdir=str(c.workdir),
            )
        )
        for how, flag in (("cold", "0"), ("warm where the zygote is ready", "1"))
    }
    for how, job in jobs.items():
        ended = c.wait_job(job.id)
        log = c.client.logs(job.id, rank=0).data
        assert ended.state == "completed", log
        [line] = [ln for ln in log.splitlines() if ln.startswith("ENV=")]
        env = json.loads(line.removeprefix("ENV="))
        assert "LEAKY_SECRET" not in env, (how, env)
        assert env["TEAM_SITE"] == "eu-west", how
        assert env["HOME"] == pwd.getpwuid(os.getuid()).pw_dir, how  # the account's
        assert env["RANK"] == "0" and env["TRAINPOD_NODE"].startswith("workers-"), how
        assert env["TRAINPOD_STATE_DIR"] == str(c.paths.state_dir), how  # a delete finds it
