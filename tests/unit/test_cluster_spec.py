"""Cluster spec loading: every bad input gives a SpecError naming the file, key path and fix."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from trainpod.controller.config import PreemptionConfig
from trainpod.errors import SpecError
from trainpod.scheduler.policy import DEFAULT_MIN_RUN_S, SharingPolicy
from trainpod.spec.cluster import (
    ClusterSpec,
    HealthPolicy,
    InstanceGroup,
    LifecycleScript,
    Partition,
    RecoveryPolicy,
    StorageSpec,
)
from trainpod.spec.loading import load_cluster_spec, parse_cluster_spec
from trainpod.spec.preemption import PreemptionPolicy
from trainpod.spec.sharing import (
    FairShareSpec,
    PriorityClassSpec,
    QuotaAmount,
    TeamSpec,
    UserSpec,
    quota_nodes,
)
from trainpod.spec.tls import ControllerSpec, TlsSpec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster.yaml"
SHARED_EXAMPLE = EXAMPLE.with_name("shared-cluster.yaml")

BASE: dict[str, Any] = {
    "name": "demo",
    "instance_groups": [
        {"name": "head", "role": "head", "count": 1, "devices_per_node": 0},
        {"name": "workers", "count": 2, "lifecycle": [{"script": "setup.sh"}]},
        {"name": "spares", "count": 1, "spare": True},
    ],
    "partitions": [{"name": "main", "groups": ["workers", "spares"]}],
}

Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    """A mutation setting ``a.0.b`` (list indices as digits) in the spec dict."""

    def apply(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return apply


def _delete(path: str) -> Mutation:
    def apply(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        del node[last]

    return apply


def _many(*mutations: Mutation) -> Mutation:
    def apply(data: dict[str, Any]) -> None:
        for mutation in mutations:
            mutation(data)

    return apply


# (id, mutation of BASE, key path in the message, fragment of the fix)
def _both(*mutations: Mutation) -> Mutation:
    def apply(data: dict[str, Any]) -> None:
        for m in mutations:
            m(data)

    return apply


BAD_SPECS: list[tuple[str, Mutation, str, str]] = [
    ("unknown-top-key", _set("bakend", "local"), "bakend", "did you mean 'backend'?"),
    (
        "unknown-group-key",
        _set("instance_groups.1.cont", 2),
        "instance_groups[1].cont",
        "allowed keys here: name, role, count",
    ),
    ("missing-count", _delete("instance_groups.1.count"), "instance_groups[1].count", "`count:"),
    ("missing-name", _delete("name"), ": name:", "add `name: <name>`"),
    ("missing-groups", _delete("instance_groups"), "instance_groups", "add `instance_groups:`"),
    ("bad-cluster-name", _set("name", "Demo"), ": name:", "lowercase letters, digits and dashes"),
    ("long-cluster-name", _set("name", "a" * 41), ": name:", "use 1-40 characters"),
    ("numeric-name", _set("name", 123), ": name:", "quote it"),
    ("bad-backend", _set("backend", "k8s"), ": backend:", "use one of: local, slurm"),
    ("bad-role", _set("instance_groups.1.role", "gpu"), "[1].role", "use one of: head, compute"),
    ("bad-group-name", _set("instance_groups.1.name", "W_1"), "[1].name", "lowercase letters"),
    ("count-quoted", _set("instance_groups.1.count", "2"), "[1].count", "whole number"),
    ("count-bool", _set("instance_groups.1.count", True), "[1].count", "whole number"),
    ("count-zero", _set("instance_groups.1.count", 0), "[1].count", "use 1 or more"),
    ("count-too-big", _set("instance_groups.1.count", 65), "[1].count", "use 64 or less"),
    (
        "devices-negative",
        _set("instance_groups.1.devices_per_node", -1),
        "devices_per",
        "use 0 or more",
    ),
    ("spare-not-bool", _set("instance_groups.2.spare", "yes"), "[2].spare", "true or false"),
    ("head-spare", _set("instance_groups.0.spare", True), "[0].spare", "remove `spare: true`"),
    ("head-count", _set("instance_groups.0.count", 2), "[0].count", "set `count: 1`"),
    (
        "two-heads",
        _set("instance_groups.2", {"name": "head2", "role": "head", "count": 1}),
        "instance_groups[2].role",
        "keep a single head group",
    ),
    (
        "only-spares",
        _many(_set("instance_groups.1.spare", True), _delete("partitions")),
        "instance_groups:",
        "without `spare: true`",
    ),
    ("no-groups", _set("instance_groups", []), "instance_groups:", "list at least 1"),
    ("groups-not-list", _set("instance_groups", "workers"), "instance_groups:", "YAML list"),
    ("dup-group", _set("instance_groups.2.name", "workers"), "[2].name", "unique name"),
    (
        "script-missing",
        _set("instance_groups.1.lifecycle.0.script", "nope.sh"),
        "instance_groups[1].lifecycle[0].script",
        "create the file or correct the path (resolved to {tmp}/nope.sh)",
    ),
    ("script-is-dir", _set("instance_groups.1.lifecycle.0.script", "."), "script", "resolved to"),
    ("script-missing-key", _delete("instance_groups.1.lifecycle.0.script"), "script", "<path>"),
    ("timeout-zero", _set("instance_groups.1.lifecycle.0.timeout_s", 0), "timeout_s", "than 0"),
    ("timeout-text", _set("instance_groups.1.lifecycle.0.timeout_s", "5m"), "timeout_s", "number"),
    ("args-int", _set("instance_groups.1.lifecycle.0.args", ["-v", 3]), "args[1]", "quote it"),
    ("storage-not-map", _set("storage", "fast"), ": storage:", "keys: shared_dir"),
    ("storage-typo", _set("storage.shared_dirr", "/x"), "storage.shared_dirr", "'shared_dir'"),
    ("uri-gs", _set("storage.checkpoint_uri", "gs://b/c"), "checkpoint_uri", "file:// or s3://"),
    ("uri-relative", _set("storage.checkpoint_uri", "file://ck"), "checkpoint_uri", "slashes"),
    ("uri-no-bucket", _set("storage.checkpoint_uri", "s3://"), "checkpoint_uri", "s3://<bucket>"),
    (
        "partition-unknown-group",
        _set("partitions.0.groups", ["workers", "wrkers"]),
        "partitions[0].groups[1]",
        "name one of the compute groups: workers, spares",
    ),
    ("partition-head", _set("partitions.0.groups", ["head"]), "groups[0]", "compute groups"),
    ("partition-twice", _set("partitions.0.groups", ["workers"] * 2), "groups[1]", "list it once"),
    ("partition-empty-groups", _set("partitions.0.groups", []), "partitions[0].groups", "least 1"),
    ("partitions-empty", _set("partitions", []), "partitions:", "remove `partitions:`"),
    (
        "two-defaults",
        _set("partitions", [{"name": n, "groups": ["workers"], "default": True} for n in "ab"]),
        "partitions[1].default",
        "at most one partition",
    ),
    (
        "dup-partition",
        _set("partitions", [{"name": "a", "groups": ["workers"]}] * 2),
        "partitions[1].name",
        "unique name",
    ),
    ("hb-typo", _set("health.heartbeat_timeout", 5), "health.heartbeat_timeout", "'heartbeat_"),
    (
        "hb-timeout-below",
        _set("health", {"heartbeat_interval_s": 5, "heartbeat_timeout_s": 2}),
        "health.heartbeat_timeout_s",
        "raise heartbeat_timeout_s",
    ),
    ("hb-interval-zero", _set("health.heartbeat_interval_s", 0), "interval_s", "greater than 0"),
    ("grace-negative", _set("recovery.teardown_grace_s", -1), "teardown_grace_s", "use 0 or more"),
    ("grace-nan", _set("recovery.teardown_grace_s", float("nan")), "grace_s", "finite number"),
    ("restarts-negative", _set("recovery.max_restarts", -1), "max_restarts", "use 0 or more"),
    ("restarts-float", _set("recovery.max_restarts", 1.5), "max_restarts", "whole number"),
    (
        "quota-partition",
        _set("teams", [{"name": "vision", "quota": {"gpu": 1}}]),
        "teams[0].quota.gpu",
        "use one of the partitions",
    ),
    (
        "quota-devices",
        _both(
            _set("instance_groups", [{"name": "workers", "count": 2, "devices_per_node": 2}]),
            _set("partitions", [{"name": "main", "groups": ["workers"]}]),
            _set("teams", [{"name": "vision", "quota": {"main": {"devices": 3}}}]),
        ),
        "teams[0].quota.main",
        "use a multiple of",
    ),
    (
        "quota-both",
        _set("teams", [{"name": "vision", "quota": {"main": {"nodes": 1, "devices": 2}}}]),
        "teams[0].quota.main",
        "exactly one of `nodes` or `devices`",
    ),
    (
        "user-team",
        _set("users", [{"name": "alice", "team": "nope"}]),
        "users[0].team",
        "use one of the teams",
    ),
    ("user-name", _set("users", [{"name": "Alice"}]), "users[0].name", "POSIX user name"),
    (
        "two-default-classes",
        _set("priority_classes", [{"name": n, "value": 1, "default": True} for n in "ab"]),
        "priority_classes[1].default",
        "at most one priority class",
    ),
    (
        "team-class",
        _set("teams", [{"name": "vision", "default_priority_class": "urgent"}]),
        "teams[0].default_priority_class",
        "use one of priority_classes",
    ),
    (
        "notice-not-a-signal",
        _set("preemption.signal", "SIGFOO"),
        "preemption.signal: 'SIGFOO' is not a signal name",
        "use one of SIGUSR1, SIGUSR2, SIGHUP",
    ),
    (
        "notice-uncatchable",
        _set("preemption.signal", "KILL"),
        "preemption.signal: 'KILL' cannot be the preemption notice: it cannot be caught",
        "use one of SIGUSR1",
    ),
    (
        "notice-is-teardown",
        _set("preemption.signal", "SIGTERM"),
        "teardown sends it after the grace period",
        "SIGUSR2",
    ),
    ("notice-grace-negative", _set("preemption.grace_s", -1), "preemption.grace_s", "0 or more"),
    ("min-run-string", _set("preemption.min_run_s", "10s"), "preemption.min_run_s", "number"),
    ("min-run-negative", _set("preemption.min_run_s", -5), "preemption.min_run_s", "0 or more"),
    ("min-run-inf", _set("preemption.min_run_s", float("inf")), "preemption.min_run_s", "finite"),
]


@pytest.fixture
def spec_dir(tmp_path: Path) -> Path:
    (tmp_path / "setup.sh").write_text("#!/bin/sh\ntrue\n")
    return tmp_path


def _write(directory: Path, data: Any) -> Path:
    path = directory / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _error(path: Path) -> str:
    with pytest.raises(SpecError) as info:
        load_cluster_spec(path)
    return str(info.value)


@pytest.mark.parametrize(
    ("mutation", "key_path", "fix"),
    [pytest.param(m, k, f, id=i) for i, m, k, f in BAD_SPECS],
)
def test_bad_spec_names_file_key_and_fix(
    spec_dir: Path, mutation: Mutation, key_path: str, fix: str
) -> None:
    data = copy.deepcopy(BASE)
    mutation(data)
    message = _error(_write(spec_dir, data))
    fix = fix.format(tmp=spec_dir)
    line = next((ln for ln in message.splitlines() if key_path in ln), None)
    assert line is not None, f"no line mentions {key_path!r}:\n{message}"
    assert line.startswith(f"{spec_dir / 'cluster.yaml'}: "), line
    assert "Fix: " in line and fix in line, line


@pytest.mark.parametrize(
    ("text", "where", "fix"),
    [
        pytest.param("", "(top level)", "starting with `name:", id="empty-file"),
        pytest.param("# only a comment\n", "(top level)", "the spec is empty", id="comment-only"),
        pytest.param("- a\n- b\n", "(top level)", "not a list", id="top-level-list"),
        pytest.param("just text\n", "(top level)", "not a str", id="top-level-scalar"),
        pytest.param(
            "name: demo\n  backend: local\n", "line 2, column", "indentation", id="indent"
        ),
        pytest.param("name: [demo\n", "line 2, column 1", "syntax", id="unclosed-bracket"),
        pytest.param("name: demo\n\tbackend: local\n", "line 2, column 1", "not tabs", id="tab"),
        pytest.param("name: a\nname: b\n", "line 2, column 1", "keep only one", id="dup-key"),
        pytest.param(
            "name: d\ninstance_groups:\n  - {name: w, count: 1, count: 2}\n",
            "line 3",
            "duplicate key 'count'",
            id="dup-nested-key",
        ),
        pytest.param(
            "name: d\n3: x\ninstance_groups: []\n", "3:", "keys must be text", id="int-key"
        ),
    ],
)
def test_bad_yaml_text(tmp_path: Path, text: str, where: str, fix: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    message = _error(path)
    assert message.startswith(f"{path}: ")
    assert where in message and fix in message, message


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    message = _error(tmp_path / "nope.yaml")
    assert str(tmp_path / "nope.yaml") in message
    assert "not found" in message and "Fix:" in message


def test_directory_instead_of_file(tmp_path: Path) -> None:
    assert "cannot read" in _error(tmp_path)


def test_all_problems_in_one_error_one_per_line(spec_dir: Path) -> None:
    data = copy.deepcopy(BASE)
    _many(_set("backend", "k8s"), _set("instance_groups.1.cont", 2), _set("name", "X"))(data)
    lines = _error(_write(spec_dir, data)).splitlines()
    assert len(lines) == 3, lines
    assert all(ln.startswith(str(spec_dir)) and "Fix: " in ln for ln in lines)


def test_long_values_are_truncated(spec_dir: Path) -> None:
    message = _error(_write(spec_dir, {**BASE, "backend": "x" * 200}))
    got = message.split("; got ")[1].split(" Fix:")[0]
    assert len(got) == 60 and got.endswith("...")


def test_parse_rejects_non_mapping_with_source() -> None:
    with pytest.raises(SpecError, match=r"^inline: \(top level\)"):
        parse_cluster_spec(["name"], source="inline", base_dir=Path("/"))


def test_example_spec_loads() -> None:
    spec = load_cluster_spec(EXAMPLE)
    assert spec.name == "demo" and spec.backend == "local"
    head, workers, spares = spec.instance_groups
    assert (head.role, head.count, head.devices_per_node) == ("head", 1, 0)
    assert (workers.count, workers.devices_per_node, workers.spare) == (2, 2, False)
    assert (spares.count, spares.devices_per_node, spares.spare) == (1, 2, True)
    for script in workers.lifecycle:
        assert script.script.is_absolute() and script.script.is_file()
    assert [s.script.name for s in workers.lifecycle] == ["setup_node.sh", "create_users.sh"]
    assert spec.default_partition().groups == ("workers", "spares")
    assert spec.storage == StorageSpec()
    assert spec.health == HealthPolicy() and spec.recovery == RecoveryPolicy()


def test_shared_example_spec_loads() -> None:
    spec = load_cluster_spec(SHARED_EXAMPLE)
    assert [c.name for c in spec.priority_classes] == ["high", "normal", "low"]
    assert {t.name: quota_nodes(spec, t) for t in spec.teams} == {
        "vision": {"default": 2},
        "nlp": {"default": 2},
    }
    assert [(u.name, u.team, u.role) for u in spec.users] == [
        ("alice", "vision", "user"),
        ("bob", "nlp", "user"),
        ("ops", None, "admin"),
    ]


def test_defaults(tmp_path: Path) -> None:
    spec = parse_cluster_spec(
        {"name": "x", "instance_groups": [{"name": "w", "count": 1}]}, "s", tmp_path
    )
    group = spec.instance_groups[0]
    assert (spec.backend, group.role, group.devices_per_node, group.spare) == (
        "local",
        "compute",
        1,
        False,
    )
    assert group.lifecycle == ()
    assert spec.storage.shared_dir is None and spec.storage.checkpoint_uri is None
    assert spec.partitions is None
    assert spec.health.heartbeat_interval_s == 1.0 and spec.health.heartbeat_timeout_s == 10.0
    assert spec.recovery.teardown_grace_s == 5.0 and spec.recovery.max_restarts == 3
    assert spec.preemption == PreemptionPolicy(signal="SIGUSR1", grace_s=30.0, min_run_s=120.0)
    # the controller's and the scheduler's defaults are the spec's, so no layer runs with 0
    assert PreemptionConfig().min_run_s == SharingPolicy().min_run_s == DEFAULT_MIN_RUN_S == 120.0
    assert LifecycleScript.model_fields["timeout_s"].default == 300.0


def test_the_notice_signal_is_stored_by_its_full_name(tmp_path: Path) -> None:
    data = {"name": "x", "instance_groups": [{"name": "w", "count": 1}]}
    spec = parse_cluster_spec({**data, "preemption": {"signal": "usr2"}}, "s", tmp_path)
    assert spec.preemption.signal == "SIGUSR2"
    assert parse_cluster_spec(spec.model_dump(mode="json"), "s", tmp_path) == spec


def test_default_partition_holds_all_compute_groups(spec_dir: Path) -> None:
    data = {k: v for k, v in BASE.items() if k != "partitions"}
    spec = load_cluster_spec(_write(spec_dir, data))
    assert spec.effective_partitions() == [
        Partition(name="default", groups=("workers", "spares"), default=True)
    ]
    assert spec.default_partition().name == "default"


def test_first_partition_is_default_when_none_marked(spec_dir: Path) -> None:
    parts = [{"name": "a", "groups": ["workers"]}, {"name": "b", "groups": ["spares"]}]
    spec = load_cluster_spec(_write(spec_dir, {**BASE, "partitions": parts}))
    assert [p.default for p in spec.effective_partitions()] == [True, False]
    marked = [parts[0], {**parts[1], "default": True}]
    spec = load_cluster_spec(_write(spec_dir, {**BASE, "partitions": marked}))
    assert spec.default_partition().name == "b"


def test_paths_resolve_against_spec_dir(spec_dir: Path) -> None:
    storage = {"shared_dir": "shared", "node_scratch_root": "/scratch", "checkpoint_uri": "ck"}
    spec = load_cluster_spec(_write(spec_dir, {**BASE, "storage": storage}))
    assert spec.storage.shared_dir == spec_dir / "shared"
    assert spec.storage.node_scratch_root == Path("/scratch")
    assert spec.storage.checkpoint_uri == f"file://{spec_dir / 'ck'}"
    assert spec.instance_groups[1].lifecycle[0].script == spec_dir / "setup.sh"


@pytest.mark.parametrize("uri", ["s3://bucket/prefix", "file:///data/ckpt"])
def test_uris_kept_as_written(spec_dir: Path, uri: str) -> None:
    spec = load_cluster_spec(_write(spec_dir, {**BASE, "storage": {"checkpoint_uri": uri}}))
    assert spec.storage.checkpoint_uri == uri


@pytest.mark.parametrize("source", ["example", "full"])
def test_round_trip(spec_dir: Path, tmp_path_factory: pytest.TempPathFactory, source: str) -> None:
    if source == "example":
        spec = load_cluster_spec(EXAMPLE)
    else:
        storage = {"shared_dir": "sh", "node_scratch_root": "nv", "checkpoint_uri": "s3://b/p"}
        spec = load_cluster_spec(_write(spec_dir, {**BASE, "storage": storage}))
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    again = parse_cluster_spec(spec.model_dump(mode="json"), source="dump", base_dir=elsewhere)
    assert again == spec
    assert again.to_json() == spec.to_json() == spec.model_dump(mode="json")


def test_node_names_order(spec_dir: Path) -> None:
    spec = load_cluster_spec(_write(spec_dir, BASE))
    assert [(n, g.name) for n, g in spec.node_names()] == [
        ("head-0", "head"),
        ("workers-0", "workers"),
        ("workers-1", "workers"),
        ("spares-0", "spares"),
    ]
    assert list(spec.groups_by_name()) == ["head", "workers", "spares"]


def test_models_are_frozen_and_hashable(spec_dir: Path) -> None:
    spec = load_cluster_spec(_write(spec_dir, BASE))
    with pytest.raises(pydantic.ValidationError):
        spec.name = "other"  # type: ignore[misc]  # assigning is the point of the test
    assert hash(spec) == hash(load_cluster_spec(_write(spec_dir, BASE)))


@pytest.mark.parametrize(
    "model",
    [
        ClusterSpec,
        InstanceGroup,
        LifecycleScript,
        StorageSpec,
        Partition,
        HealthPolicy,
        PriorityClassSpec,
        TeamSpec,
        UserSpec,
        QuotaAmount,
        FairShareSpec,
        ControllerSpec,
        TlsSpec,
    ],
)
def test_every_field_is_documented(model: type[pydantic.BaseModel]) -> None:
    for name, field in model.model_fields.items():
        assert field.description, f"{model.__name__}.{name} has no docstring"
