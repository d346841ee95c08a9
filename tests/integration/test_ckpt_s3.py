"""The durable tier on ``s3://`` through s3fs, against a real S3-compatible server (moto's
server mode on localhost, reset before each test): commit, retention, load from S3 alone,
corrupt and truncated objects, a store that goes down and comes back, configuration by
environment."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from fsspec.core import url_to_fs  # type: ignore[import-untyped]  # no type hints

from tests.integration.s3server import FAKE_AWS_ENV, UNSET_AWS_ENV, S3Server
from trainpod.ckpt import Checkpointer
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.integration

BUCKET = "trainpod-ckpt"
PREFIX = "run"
URL = f"s3://{BUCKET}/{PREFIX}"
TRAINPOD_VARS = [
    "TRAINPOD_CHECKPOINT_URI", "TRAINPOD_CHECKPOINT_DIR", "TRAINPOD_SCRATCH_DIR",
    "TRAINPOD_JOB_SCRATCH_DIR", "TRAINPOD_NODE", "TRAINPOD_NODES", "TRAINPOD_JOB_ID",
    "TRAINPOD_ATTEMPT", "TRAINPOD_BEACON_SOCKET", "TRAINPOD_ATTEMPT_ID",
]  # fmt: skip


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One moto server for the module (it starts in about a second); stopped at the end."""
    with S3Server(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """The server, running (again, if a test stopped it) and empty but for ``BUCKET``."""
    import s3fs  # type: ignore[import-untyped]  # no type hints

    for var in TRAINPOD_VARS + list(UNSET_AWS_ENV):
        monkeypatch.delenv(var, raising=False)
    for var, value in FAKE_AWS_ENV.items():
        monkeypatch.setenv(var, value)
    s3_server.start()
    s3_server.reset()
    s3_server.create_bucket(BUCKET)
    # fsspec shares one S3FileSystem per set of options, with its listing cache: a test must
    # not see the listings of the one before (same endpoint, same bucket).
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3_server
    s3fs.S3FileSystem.clear_instance_cache()


def make_state(seed: float = 0.0) -> dict[str, Any]:
    torch.manual_seed(int(seed))  # the bias differs from seed to seed, and is reproducible
    model = torch.nn.Linear(16, 8)
    with torch.no_grad():
        model.weight.fill_(seed)
    return {"model": model, "t": torch.arange(10.0) + seed, "extra": {"epoch": int(seed)}}


@contextmanager
def checkpointer(root: Path, s3: S3Server | None, **kw: Any) -> Iterator[Checkpointer]:
    """Durable on S3; memory and scratch tiers under ``root`` (a new root: a new node).

    Closed with a timeout: a plain ``close()`` waits for the durable copy for ever, which
    would hang a failing test whose store is down.
    """
    if s3 is not None:
        kw.setdefault("dir", URL)
        kw.setdefault("storage_options", s3.storage_options)
    ck = Checkpointer(memory=root / "shm", scratch_dir=root / "scratch", every=1, **kw)
    try:
        yield ck
    except BaseException:
        ck.close(timeout_s=5)
        raise
    assert ck.close(timeout_s=30), ck.progress()


def load_fresh(
    root: Path, s3: S3Server | None
) -> tuple[int | None, str | None, Any, dict[str, Any]]:
    """Load on a node whose memory and scratch are empty: only S3 has checkpoints."""
    assert not root.exists()
    state = make_state(0.0)
    with checkpointer(root, s3) as ck:
        step = ck.load_latest(state)
        assert ck.last_load is not None
        return step, ck.last_load.tier, ck.last_load.reasons, state


def steps_in(s3: S3Server) -> list[str]:
    return sorted({k.split("/")[1] for k in s3.keys(BUCKET, f"{PREFIX}/") if "/step-" in k})


def object_key(step: int, name: str) -> str:
    return f"{PREFIX}/step-{step:010d}/{name}"


def test_saves_reach_s3_and_a_new_node_loads_from_there(tmp_path: Path, s3: S3Server) -> None:
    with checkpointer(tmp_path / "a", s3, keep={"durable": 2}) as ck:
        for step in (1, 2, 3):
            ck.save(step, make_state(step))
            assert ck.wait(timeout_s=30)  # each step reaches S3 (else only the newest would)
        p = ck.progress()
        assert p.committed["durable"] == 3 and p.errors == {}, p
    keys = s3.keys(BUCKET)
    # Retention: the two newest committed steps, each with DCP files and its manifest.
    assert steps_in(s3) == ["step-0000000002", "step-0000000003"], keys
    for step in (2, 3):
        for name in ("manifest.json", ".metadata", "__0_0.distcp"):
            assert object_key(step, name) in keys, keys
    assert not [k for k in keys if ".tmp-" in k], keys  # the put-then-move left nothing behind
    latest = s3.client().get_object(Bucket=BUCKET, Key=f"{PREFIX}/latest")["Body"].read()
    assert latest == b"3\n"

    loaded, tier, reasons, state = load_fresh(tmp_path / "b", s3)
    assert (loaded, tier, reasons) == (3, "durable", ())
    expected = make_state(3)
    assert torch.equal(state["model"].weight, expected["model"].weight)
    assert torch.equal(state["model"].bias, expected["model"].bias)
    assert torch.equal(state["t"], expected["t"]) and state["extra"] == {"epoch": 3}


def _flip(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 0x40
    return bytes(b)


@pytest.mark.parametrize(
    ("name", "damage", "why"),
    [
        ("__0_0.distcp", _flip, "__0_0.distcp: crc32c mismatch (corrupt)"),
        ("__0_0.distcp", lambda d: d[:100], "__0_0.distcp: 100 bytes, manifest says"),
        (".metadata", _flip, ".metadata: crc32c mismatch (corrupt)"),
        ("manifest.json", lambda d: d[: len(d) // 2], "malformed manifest"),
        ("manifest.json", None, "no manifest (torn or in flight)"),
    ],
    ids=["flipped-shard", "truncated-shard", "flipped-metadata", "torn-manifest", "no-manifest"],
)
def test_damaged_object_falls_back_to_the_previous_step(
    tmp_path: Path, s3: S3Server, name: str, damage: Any, why: str
) -> None:
    with checkpointer(tmp_path / "a", s3) as ck:
        for step in (1, 2):
            ck.save(step, make_state(step))
            # Each step reaches S3 before the next is saved: saved back to back, step 1 is
            # passed over for the newer one whenever its upload has not begun (a busy box),
            # and there is nothing to fall back to. CI lost a run to it.
            assert ck.wait(timeout_s=30)
    client, key = s3.client(), object_key(2, name)
    if damage is None:
        client.delete_object(Bucket=BUCKET, Key=key)
    else:
        data = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        client.put_object(Bucket=BUCKET, Key=key, Body=damage(data))

    loaded, tier, reasons, state = load_fresh(tmp_path / "b", s3)
    assert (loaded, tier) == (1, "durable")
    assert torch.equal(state["t"], torch.arange(10.0) + 1) and state["extra"] == {"epoch": 1}
    assert any("step 2" in r and why in r for r in reasons), reasons


@pytest.mark.timeout(120)
def test_store_down_during_saves_then_the_newest_step_lands(tmp_path: Path, s3: S3Server) -> None:
    with checkpointer(tmp_path / "a", s3, retry_base_s=0.05) as ck:
        ck.save(1, make_state(1))
        assert ck.wait(timeout_s=30)
        s3.stop()
        for step in (2, 3):  # training goes on: saves return, the local tiers commit
            ck.save(step, make_state(step))
        wait_until(
            lambda: "durable" in (p := ck.progress()).errors and p.committed["scratch"] == 3 and p,
            what="local commits of step 3 and a failed durable copy",
        )
        p = ck.progress()
        assert p.committed["durable"] == 1 and p.retry_in_s is not None
        err = p.errors["durable"]  # botocore's EndpointConnectionError (or a closed socket)
        assert "endpoint URL" in err and s3.endpoint in err, err
        assert not ck.wait(timeout_s=0.2)
        # moto keeps objects in memory: the store comes back empty (step 1 is gone) and we
        # create the bucket again, as an operator restoring the store would.
        s3.start()
        s3.create_bucket(BUCKET)
        assert ck.wait(timeout_s=30)
        p = ck.progress()
        assert p.committed["durable"] == 3 and "durable" not in p.errors, p
    assert steps_in(s3) == ["step-0000000003"]  # the newest step only, not the backlog
    loaded, tier, _, state = load_fresh(tmp_path / "b", s3)
    assert (loaded, tier) == (3, "durable") and state["extra"] == {"epoch": 3}


def test_store_down_at_load_is_a_reason_and_local_tiers_serve(tmp_path: Path, s3: S3Server) -> None:
    with checkpointer(tmp_path / "a", s3) as ck:
        ck.save(1, make_state(1))
        assert ck.wait(timeout_s=30)
    s3.stop()
    state = make_state(0.0)
    with checkpointer(tmp_path / "a", s3) as ck:
        assert ck.load_latest(state) == 1
        # scratch: the first Checkpointer's clean close released its memory tier
        assert ck.last_load is not None and ck.last_load.tier == "scratch"
        assert any("durable: cannot list" in r for r in ck.last_load.reasons), ck.last_load


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_endpoint_from_the_environment_alone(
    tmp_path: Path, s3: S3Server, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    """What a worker of a cluster with ``checkpoint_uri: s3://...`` gets: the URI and the
    AWS variables in its environment, no ``storage_options``. botocore (>= 1.31, under
    aiobotocore) reads the endpoint, credentials and region from the environment."""
    # (fsspec caches S3FileSystem() by its arguments, not by the environment it was built
    # in: the s3 fixture clears that cache around each test.)
    monkeypatch.setenv("TRAINPOD_CHECKPOINT_URI", f"{URL}/job-1")
    monkeypatch.setenv(variable, s3.endpoint)
    with checkpointer(tmp_path / "a", None) as ck:
        ck.save(5, make_state(5))
        assert ck.wait(timeout_s=30)
        assert ck.progress().committed["durable"] == 5
    assert f"{PREFIX}/job-1/step-0000000005/manifest.json" in s3.keys(BUCKET)
    step, tier, _, state = load_fresh(tmp_path / "b", None)
    assert (step, tier) == (5, "durable") and state["extra"] == {"epoch": 5}


def test_store_lost_between_listing_and_reading_is_a_reason(tmp_path: Path, s3: S3Server) -> None:
    """The store answers the listing, then is gone when the manifest is read: load_latest
    must pass the durable copy over (a reason) and load from the local tiers."""
    with checkpointer(tmp_path / "a", s3) as ck:
        ck.save(1, make_state(1))
        assert ck.wait(timeout_s=30)
    # s3fs caches listings per file system instance, and fsspec shares the instance between
    # Checkpointers with the same options: list now, so that the load's listing is served
    # from the cache while its read of manifest.json goes to the store (now stopped).
    fs, root = url_to_fs(URL, **s3.storage_options)
    fs.ls(f"{root}/step-0000000001")
    s3.stop()
    state = make_state(0.0)
    with checkpointer(tmp_path / "a", s3) as ck:
        assert ck.load_latest(state) == 1
        # scratch: the first Checkpointer's clean close released its memory tier
        assert ck.last_load is not None and ck.last_load.tier == "scratch"
        assert any("durable" in r for r in ck.last_load.reasons), ck.last_load
