"""The trainpod home a shell running as the caller's account gets: the caller's token, never
the cluster's admin token, the account's alone."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from trainpod.agent.accounts import RunAs
from trainpod.cli.shellhome import shell_home
from trainpod.paths import ClusterPaths, ClusterRecord

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="giving files to an account needs root")

NOBODY = RunAs("nobody", 65534, 65534, (), "/nonexistent", "/bin/sh")


@pytest.fixture
def paths(tmp_path: Path) -> ClusterPaths:
    p = ClusterPaths.of("c1", home=tmp_path / "root-home")
    p.state_dir.mkdir(parents=True)
    ClusterRecord(
        name="c1",
        backend="local",
        spec={},
        spec_path="/x.yaml",
        host="127.0.0.1",
        port=8000,
        created_at=0.0,
        shared_dir="/shared",
        scratch_root="/scratch",
        checkpoint_uri="file:///ckpt",
    ).save(p.record)
    p.admin_token.write_text("tp_admin")
    return p


def test_the_shell_gets_the_callers_token_in_a_home_only_its_account_enters(
    paths: ClusterPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINPOD_TOKEN", "tp_alice")
    home = shell_home(paths, NOBODY)
    assert home.path is not None
    try:
        ours = ClusterPaths.of("c1", home=home.path)
        assert home.env == {"TRAINPOD_HOME": str(home.path), "TRAINPOD_CLUSTER": "c1"}
        assert ClusterRecord.load(ours).url == "http://127.0.0.1:8000"
        token = home.path / "tokens" / "c1.token"
        assert token.read_text() == "tp_alice"
        assert not ours.admin_token.exists()
        for p in [home.path, *home.path.rglob("*")]:
            st = p.lstat()
            mode = 0o700 if p.is_dir() else 0o600 if p == token else stat.S_IMODE(st.st_mode)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY.uid, mode), p
    finally:
        home.remove()
    assert not home.path.exists()


def test_the_clusters_admin_token_is_never_handed_to_an_account(
    paths: ClusterPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINPOD_TOKEN", "tp_admin")
    home = shell_home(paths, NOBODY)
    assert (home.path, home.env) == (None, {})
    assert shell_home(paths, None).path is None  # the CLI's own user has its home already
