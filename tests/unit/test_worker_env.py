"""``env_allow``: what of the agent's environment reaches workers (ADR 0032)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainpod.agent.launcher import inheritance
from trainpod.agent.warmstart import zygote_env
from trainpod.errors import SpecError
from trainpod.spec.loading import parse_cluster_spec
from trainpod.spec.workerenv import DEFAULT_ENV_ALLOW, allowed

SPEC = {"name": "demo", "instance_groups": [{"name": "workers", "count": 1}]}

AGENT_ENV = {
    "PATH": "/usr/bin",
    "LC_CTYPE": "C.UTF-8",
    "LANG": "C",
    "PYTHONPATH": "/src",
    "AWS_SECRET_ACCESS_KEY": "creator's",
    "TRAINPOD_TOKEN": "tp_creator",
    "HOME": "/root",
    "TRAINPOD_STATE_DIR": "/h/clusters/demo",
    "PYTHONDONTWRITEBYTECODE": "1",
}


def test_the_default_keeps_how_to_run_and_drops_the_rest() -> None:
    kept = inheritance(AGENT_ENV, DEFAULT_ENV_ALLOW)
    assert kept == {
        "PATH": "/usr/bin",
        "LC_CTYPE": "C.UTF-8",
        "LANG": "C",
        "PYTHONPATH": "/src",
        "TRAINPOD_STATE_DIR": "/h/clusters/demo",  # trainpod's: how a delete finds workers
    }


def test_names_and_prefixes_and_star() -> None:
    assert allowed(AGENT_ENV, ["AWS_*"]) == {"AWS_SECRET_ACCESS_KEY": "creator's"}
    assert allowed(AGENT_ENV, ["LANG"]) == {"LANG": "C"}  # a name is not a prefix
    assert set(allowed(AGENT_ENV, ["*"])) == set(AGENT_ENV) - {"HOME"}  # HOME: the account's


def test_the_zygote_keeps_what_it_needs_but_no_load_time_variable_its_ranks_lack() -> None:
    env = zygote_env(AGENT_ENV, inheritance(AGENT_ENV, DEFAULT_ENV_ALLOW))
    assert "PYTHONDONTWRITEBYTECODE" not in env  # else no rank could start warm
    assert env["PYTHONPATH"] == "/src" and env["TRAINPOD_TOKEN"] == "tp_creator"  # trainpod's


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("1BAD", "'1BAD' is not a variable name or a prefix ending in '*'"),
        ("A-B", "'A-B' is not a variable name"),
        ("HOME", "HOME is always the account's the worker runs as"),
    ],
)
def test_a_bad_entry_is_named_with_its_fix(entry: str, says: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_cluster_spec({**SPEC, "env_allow": ["PATH", entry]}, "s.yaml", Path("/"))
    assert "env_allow[1]" in str(info.value) and says in str(info.value), info.value


def test_the_spec_round_trips_its_allow_list() -> None:
    spec = parse_cluster_spec({**SPEC, "env_allow": ["PATH", "LC_*"]}, "s.yaml", Path("/"))
    assert spec.env_allow == ("PATH", "LC_*")
    assert parse_cluster_spec(spec.to_json(), "s", Path("/")) == spec
    assert parse_cluster_spec(SPEC, "s", Path("/")).env_allow == DEFAULT_ENV_ALLOW
