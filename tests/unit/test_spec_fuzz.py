"""Hypothesis over cluster specs (YAML files), job specs and ``trainpod submit``'s options:
every bad input is a clear error that names the key (or option) and the fix, never a
traceback (issue 14)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from trainpod.cli.main import app
from trainpod.errors import SpecError, TrainpodError
from trainpod.spec.job import JobSpec
from trainpod.spec.loading import load_cluster_spec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "shared-cluster.yaml"
BASE: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
FUZZ = settings(
    max_examples=25,
    deadline=None,
    database=None,
    derandomize=True,  # the same inputs every CI run: a failure is reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
HOSTILE = st.sampled_from(
    ["$(touch canary)", "`id`", "'", '"', "a\nb", "../../x", "\x00", "\udcff", "x" * 5000, ""]
)
TEXT = st.one_of(HOSTILE, st.text(max_size=30))
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)


def _paths(node: Any, at: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every key path in ``node`` (dict keys and list indices)."""
    out = [at] if at else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


PATHS = _paths(BASE)


@st.composite
def mutated_specs(draw: st.DrawFn) -> tuple[dict[str, Any], tuple[str | int, ...]]:
    """The example shared cluster with one key's value replaced, the key removed, or an
    unknown key added next to it; with the path of what changed."""
    spec = copy.deepcopy(BASE)
    path = draw(st.sampled_from(PATHS))
    parent: Any = spec
    for part in path[:-1]:
        parent = parent[part]
    how = draw(st.sampled_from(["set", "delete", "add"]))
    if how == "set":
        parent[path[-1]] = draw(VALUES)
    elif how == "delete":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        key = draw(st.from_regex(r"[a-z_]{1,12}", fullmatch=True).filter(lambda k: k not in parent))
        parent[key] = draw(VALUES)
        path = (*path[:-1], key)
    return spec, path


@FUZZ
@given(case=mutated_specs())
def test_a_mutated_cluster_spec_loads_or_names_the_key_and_the_fix(
    case: tuple[dict[str, Any], tuple[str | int, ...]], tmp_path: Path
) -> None:
    spec, path = case
    file = tmp_path / "cluster.yaml"
    file.write_bytes(yaml.safe_dump(spec, allow_unicode=True).encode("utf-8", "surrogateescape"))
    try:
        load_cluster_spec(file)
    except SpecError as exc:
        message = str(exc)
        assert "Traceback" not in message
        assert str(file) in message and "Fix:" in message, message
        # Each line names a key path (a cross-reference, e.g. a user's team, names the key
        # that refers; the key changed is one of those named, or the one that refers to it).
        named = [str(p) for p in path if isinstance(p, str)]
        assert any(f"{n}" in message for n in named) or not named, (path, message)


@FUZZ
@given(data=st.binary(max_size=200))
def test_any_bytes_as_a_cluster_spec_load_or_are_a_clear_error(data: bytes, tmp_path: Path) -> None:
    file = tmp_path / "cluster.yaml"
    file.write_bytes(data)
    try:
        load_cluster_spec(file)
    except SpecError as exc:
        assert "Traceback" not in str(exc) and str(file) in str(exc)


JOB_FIELDS = sorted(JobSpec.model_fields)


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(JOB_FIELDS), VALUES, max_size=4))
def test_a_fuzzed_job_spec_is_valid_or_each_error_names_its_field(fields: dict[str, Any]) -> None:
    try:
        JobSpec.model_validate({"command": ["train"], **fields})
    except pydantic.ValidationError as exc:
        for error in exc.errors():
            assert not error["loc"] or error["loc"][0] in fields, error
            assert error["msg"], error


OPTIONS = {
    "--nodes": st.one_of(st.integers(-5, 5000).map(str), TEXT),
    "--procs-per-node": st.one_of(st.integers(-5, 500).map(str), TEXT),
    "--partition": TEXT,
    "--name": TEXT,
    "--env": st.one_of(TEXT, st.tuples(TEXT, TEXT).map("=".join)),
    "--workdir": TEXT,
    "--max-restarts": st.one_of(st.integers(-5, 5).map(str), TEXT),
    "--recovery": st.one_of(st.sampled_from(["restart", "in-process"]), TEXT),
    "--min-nodes": st.one_of(st.integers(-5, 5).map(str), TEXT),
    "--hang-timeout-s": st.one_of(st.floats(allow_nan=True).map(str), TEXT),
    "--spares": st.one_of(st.integers(-5, 100).map(str), TEXT),
    "--time": st.one_of(st.sampled_from(["90", "1:00:00", "1-2"]), TEXT),
    "--priority-class": TEXT,
    "--nice": st.one_of(st.integers().map(str), TEXT),
    "--dependency": st.one_of(st.just("afterok:1"), TEXT),
    "--exclude": st.one_of(st.just("node1,node2"), TEXT),
}


@st.composite
def submit_args(draw: st.DrawFn) -> list[str]:
    chosen = draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=4, unique=True))
    args = ["submit"]
    for option in chosen:
        args += [option, draw(OPTIONS[option])]
    return [*args, "--", *draw(st.lists(TEXT, min_size=1, max_size=3))]


@FUZZ
@given(args=submit_args())
def test_fuzzed_submit_options_are_refused_by_name_never_with_a_traceback(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINPOD_HOME", str(tmp_path / "home"))  # no cluster: nothing sent
    monkeypatch.delenv("TRAINPOD_CLUSTER", raising=False)
    result = CliRunner().invoke(app, args)
    assert "Traceback" not in result.output
    exc = result.exception
    if exc is None or isinstance(exc, SystemExit):  # typer's usage errors name the option
        assert result.exit_code == 0 or "Usage" in result.output or "option" in result.output
        return
    assert isinstance(exc, TrainpodError), f"{args!r} raised {exc!r}"
    if isinstance(exc, SpecError):
        message = str(exc)
        named = [a for a in args if a.startswith("--")] + ["the command", "argument"]
        assert any(n in message for n in named), (args, message)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--dependency", "afterok:1\ntouch canary"], "--dependency"),
        (["--nodes", "0"], "--nodes"),
        (["--partition", "../../x"], "--partition"),
        (["--name", "x\ny"], "--name"),
        (["--exclude", "$(touch canary)"], "--exclude"),
        (["--hang-timeout-s", "-1"], "--hang-timeout-s"),
    ],
)
def test_bad_submit_options_are_refused_naming_the_option(
    args: list[str], names: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINPOD_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["submit", *args, "--", "true"])
    assert isinstance(result.exception, SpecError), result.output
    assert str(result.exception).startswith(names), str(result.exception)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        ([b"--env", b"A;touch canary=1"], "--env key 'A;touch canary'"),
        ([b"--", b"python", b"\xff\xfe"], "argument 1 of the command is not valid UTF-8"),
    ],
)
def test_the_real_cli_answers_bad_options_with_one_line_naming_them(
    args: list[bytes], names: str, tmp_path: Path
) -> None:
    tail = [] if b"--" in args else [b"--", b"true"]
    run = subprocess.run(
        [sys.executable.encode(), b"-m", b"trainpod.cli.main", b"submit", *args, *tail],
        capture_output=True,
        check=False,
        timeout=60,
        env={**os.environ, "TRAINPOD_HOME": str(tmp_path), "COLUMNS": "300"},
    )
    err = run.stderr.decode("utf-8", "replace")
    assert run.returncode == 2 and "Traceback" not in err, err
    assert names in err, err
