"""Checkpoint locations from arguments and trainpod's environment; the Young/Daly interval."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest

from trainpod.ckpt.errors import CheckpointConfigError, ManifestError
from trainpod.ckpt.layout import DEFAULT_MTBF_S, mtbf_s, private_dir, resolve, young_daly_s
from trainpod.ckpt.manifest import METADATA, FileEntry, Manifest, write_atomic

ENV = {
    "TRAINPOD_CHECKPOINT_URI": "file:///shared/ckpt/job-7",
    "TRAINPOD_CHECKPOINT_DIR": "/shared/ckpt/job-7",
    "TRAINPOD_SCRATCH_DIR": "/scratch/n1",
    "TRAINPOD_JOB_SCRATCH_DIR": "/scratch/n1/job-7",
    "TRAINPOD_NODE": "n1",
    "TRAINPOD_NODES": "n0,n1,n2",
    "TRAINPOD_JOB_ID": "7",
    "TRAINPOD_ATTEMPT": "3",
}


def test_under_trainpod_every_tier_comes_from_the_environment() -> None:
    lay = resolve(None, env=ENV)
    assert lay.durable == "/shared/ckpt/job-7"
    assert (lay.node, lay.nodes, lay.attempt) == ("n1", ("n0", "n1", "n2"), 3)
    # Job ids repeat across clusters: the key also hashes the (per cluster) durable dir.
    assert lay.job_key.startswith("job-7-") and lay.job_key != resolve("/other", env=ENV).job_key
    assert lay.memory is not None and lay.memory.parts[-3:] == ("trainpod", lay.job_key, "n1")
    assert lay.scratch == Path("/scratch/n1/job-7/ckpt")
    # The peer of a node is the next one in TRAINPOD_NODES, on the same scratch layout.
    assert lay.peer_of("n1") == "n2" and lay.peer_of("n2") == "n0"
    assert lay.peer_root("n2") == Path("/scratch/n2/job-7/ckpt-peer")


def test_uri_without_local_dir_is_used_as_a_url() -> None:
    env = dict(ENV, TRAINPOD_CHECKPOINT_URI="s3://bucket/ckpt/job-7")
    del env["TRAINPOD_CHECKPOINT_DIR"]
    assert resolve(None, env=env).durable == "s3://bucket/ckpt/job-7"


def test_explicit_arguments_win_over_the_environment(tmp_path: Path) -> None:
    lay = resolve(tmp_path / "d", memory=tmp_path / "m", scratch_dir=tmp_path / "s", env=ENV)
    assert lay.durable == str(tmp_path / "d")
    assert lay.memory == tmp_path / "m" / lay.job_key / "n1"
    assert lay.scratch == tmp_path / "s" / "n1" / lay.job_key / "ckpt"
    assert lay.peer_root("n0") == tmp_path / "s" / "n0" / lay.job_key / "ckpt-peer"
    assert resolve(tmp_path, memory=False, env=ENV).memory is None


def test_outside_trainpod_a_directory_is_enough(tmp_path: Path) -> None:
    lay = resolve(tmp_path, env={})
    assert lay.durable == str(tmp_path) and lay.scratch is None and lay.scratch_base is None
    assert lay.job_key.startswith("dir-") and lay.nodes == (lay.node,)
    assert lay.peer_of(lay.node) is None
    # The same directory always maps to the same shared-memory dir (in-job restarts find it).
    assert resolve(str(tmp_path) + "/", env={}).memory == lay.memory


def test_no_location_is_a_config_error_that_says_what_to_do() -> None:
    with pytest.raises(CheckpointConfigError, match="dir="):
        resolve(None, env={})


def test_young_daly_interval() -> None:
    # The performance notes' example: delta = 5 s, M = 3.1 h gives sqrt(2 delta M) = 5.57 min,
    # less delta: 5.48 min.
    assert young_daly_s(5.0, 3.1 * 3600) == pytest.approx(math.sqrt(2 * 5 * 3.1 * 3600) - 5)
    assert 5.4 * 60 < young_daly_s(5.0, 3.1 * 3600) < 5.6 * 60
    assert young_daly_s(100.0, 10.0) == 10.0  # stall >= 2M: checkpoint every M
    assert young_daly_s(0.0, 60.0) == 60.0


def test_mtbf_argument_then_environment_then_default() -> None:
    assert mtbf_s(123.0, {"TRAINPOD_MTBF_S": "9"}) == 123.0
    assert mtbf_s(None, {"TRAINPOD_MTBF_S": "9"}) == 9.0
    assert mtbf_s(None, {"TRAINPOD_MTBF_S": "soon"}) == DEFAULT_MTBF_S
    assert mtbf_s(None, {}) == DEFAULT_MTBF_S == 4 * 3600


def _manifest() -> Manifest:
    files = (
        FileEntry("__0_0.distcp", 10, "a" * 64, 0, "n0"),
        FileEntry("__1_0.distcp", 12, "b" * 64, 1, "n1"),
        FileEntry(METADATA, 3, "c" * 64, None, "n0"),
    )
    return Manifest(5, 2, ("n0", "n1"), files, "job-7", 2)


def test_manifest_round_trip_and_node_parts() -> None:
    m = _manifest()
    assert Manifest.from_json(m.to_json()) == m
    assert [f.name for f in m.files_of("n1")] == ["__1_0.distcp", METADATA]
    assert m.total_bytes() == 25


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.update(format="other/9"),
        lambda b: b.pop("step"),
        lambda b: b["files"][0].update(size="ten"),
        lambda b: b.update(files=[f for f in b["files"] if f["name"] != METADATA]),
    ],
)
def test_malformed_manifests_are_rejected(mutate: object) -> None:
    body = json.loads(_manifest().to_json())
    mutate(body)  # type: ignore[operator]
    with pytest.raises(ManifestError):
        Manifest.from_json(json.dumps(body).encode())
    with pytest.raises(ManifestError):
        Manifest.from_json(b'{"format": "trainpod-ckpt/1", "step": 1')  # torn write


def test_atomic_write_replaces_whole_files(tmp_path: Path) -> None:
    p = tmp_path / "manifest.json"
    write_atomic(p, b"one")
    write_atomic(p, b"two", sync=False)
    assert p.read_bytes() == b"two"
    assert [x.name for x in tmp_path.iterdir()] == ["manifest.json"]  # no tmp left behind


def test_meter_reports_progress_and_counts_bytes() -> None:
    from trainpod.ckpt.tiers import Meter

    seen: list[tuple[int | None, str | None, int, int]] = []
    meter = Meter(None, on_progress=lambda m: seen.append((m.step, m.tier, m.done, m.total)))
    meter.start(7, "durable", 300)
    meter.add(100, throttled=True)
    meter.add(200, throttled=True)  # within a second of the first: no second report
    assert seen == [(7, "durable", 100, 300)] and meter.done == 300


def test_a_private_dir_is_0700_whatever_the_umask_and_an_existing_one_is_tightened(
    tmp_path: Path,
) -> None:
    old = os.umask(0o002)
    try:
        made = private_dir(tmp_path / "base" / "job-1-abc")
    finally:
        os.umask(old)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    made.chmod(0o755)  # e.g. made by an older worker under its umask
    private_dir(made)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


def test_a_private_dir_that_is_a_link_or_another_accounts_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "job-2-abc"
    link.symlink_to(real)
    with pytest.raises(CheckpointConfigError, match="not a directory of uid"):
        private_dir(link)
    if os.geteuid() != 0:
        return  # only root can make a directory another uid owns
    theirs = tmp_path / "job-3-abc"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(CheckpointConfigError, match=r"a directory of uid 65534.*another account"):
        private_dir(theirs)
