"""What a rank that runs as a POSIX account may say on the agent's sockets: real sockets, real
processes of other uids (so root only), real directories.

The beacon server books an account's beacons only for the attempts granted to it; the
checkpoint hub takes hand-offs only for the account's own jobs and of a primary tier the
account owns; :class:`AccountSockets` gives each account a directory of its own."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainpod.agent.accounts import Grants, RunAs
from trainpod.agent.beacons import BeaconServer
from trainpod.agent.jobsockets import AccountSockets, shared_memory_base
from trainpod.agent.persisters import CheckpointHub
from trainpod.ckpt.handoff import TierConfig
from trainpod.ckpt.tiers import step_name
from trainpod.testing.wait import wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="other uids need root")
SYSTEM_PYTHON = Path("/usr/bin/python3")  # one other uids may run (ours may be under /root)
ALICE = RunAs("alice", 65533, 65533, (), "/tmp", "/bin/sh")
STRANGER = 65534

# Sends one beacon per attempt id in argv[2:] (step 1) on the socket argv[1], as its user.
_SEND = """
import json, socket, sys, time
c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
c.connect(sys.argv[1])
for a in sys.argv[2:]:
    c.send(json.dumps({"v": 1, "a": int(a), "r": 0, "s": 1, "t": time.time()}).encode())
c.close()
"""


@pytest.fixture
def d() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tpas-", dir="/tmp"))  # short: sun_path is 108 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _as(uid: int, *argv: str) -> None:
    if not SYSTEM_PYTHON.exists():
        pytest.skip("needs /usr/bin/python3 for other uids")
    subprocess.run(
        [str(SYSTEM_PYTHON), "-c", *argv],
        user=uid,
        group=uid,
        extra_groups=[],
        capture_output=True,
        timeout=60,
        check=True,
    )


def test_an_account_reports_only_for_its_own_attempts(d: Path) -> None:
    grants = Grants()
    grants.grant(ALICE, attempt_id=7, job_id=3)
    server = BeaconServer(d / "agent.sock", grants=grants)
    try:
        theirs = d / "alice.sock"
        server.add_listener(theirs, uid=ALICE.uid, gid=ALICE.gid)
        d.chmod(0o755)
        _as(ALICE.uid, _SEND, str(theirs), "7", "8")  # 8: someone else's attempt
        wait_until(lambda: server.received + server.refused == 2, what="both beacons")
        assert (server.received, server.refused) == (1, 1)
        assert server.book.attempts() == [7]
    finally:
        server.close()


def test_the_hub_takes_an_accounts_hand_offs_only_for_its_jobs_and_of_its_files(
    d: Path,
) -> None:
    grants = Grants()
    grants.grant(ALICE, attempt_id=7, job_id=3)
    hub = CheckpointHub(d / "c.sock", log_dir=d / "logs", grants=grants)
    mine, roots = d / "mine" / "n0", d / "roots" / "n0"
    for primary in (mine, roots):
        (primary / step_name(5)).mkdir(parents=True)
    os.chown(mine, ALICE.uid, ALICE.gid)

    def persist(job_id: int, primary: Path, uid: int) -> str:
        tiers = TierConfig(node="n0", memory=str(primary)).to_dict()
        msg = {"op": "persist", "job_key": "job-3-x", "node": "n0", "step": 5}
        reply = hub.handle({**msg, "job_id": job_id, "tiers": tiers}, uid=uid)
        assert not reply["ok"]
        return str(reply["error"])

    try:
        assert "uid 65534 runs no job on this node" in persist(3, mine, STRANGER)
        assert "job 4 does not run as alice" in persist(4, mine, ALICE.uid)
        assert f"{roots} is not a directory of alice" in persist(3, roots, ALICE.uid)
        status = {"op": "status", "job_key": "job-3-x", "node": "n0"}
        assert hub.handle(status, uid=ALICE.uid) == {"ok": True, "status": {}}
        assert not hub.handle(status, uid=STRANGER)["ok"]
    finally:
        hub.close()


def test_each_account_gets_a_directory_of_its_own(d: Path) -> None:
    grants = Grants()
    base = d / "run"
    base.mkdir(mode=0o700)
    server = BeaconServer(base / "n0.sock", grants=grants)
    hub = CheckpointHub(base / "n0.ckpt.sock", log_dir=d / "logs", grants=grants)
    sockets = AccountSockets(
        base, "n0", beacons=server, checkpoints=hub, grants=grants, memory_base=d / "shm" / "tp"
    )
    try:
        env = sockets.env_for(ALICE, attempt_id=7, job_id=3)
        beacon, ckpt = Path(env["TRAINPOD_BEACON_SOCKET"]), Path(env["TRAINPOD_CKPT_SOCKET"])
        theirs = base / "u65533"
        assert beacon == theirs / "n0.sock" and ckpt == theirs / "n0.ckpt.sock"
        st = theirs.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (ALICE.uid, 0o700)
        assert stat.S_IMODE(base.stat().st_mode) == 0o711  # enter, not list
        assert beacon.stat().st_uid == ALICE.uid and ckpt.stat().st_uid == ALICE.uid
        assert grants.may_report(ALICE.uid, 7) and not grants.may_report(ALICE.uid, 8)
        assert grants.may_checkpoint(ALICE.uid, 3) and not grants.may_checkpoint(STRANGER, 3)
        assert stat.S_IMODE((d / "shm" / "tp").stat().st_mode) == 0o1777
        # Another attempt of the same account reuses its sockets.
        assert sockets.env_for(ALICE, attempt_id=9, job_id=3) == env
    finally:
        server.close()
        hub.close()
    assert not beacon.exists() and not ckpt.exists()


def test_a_memory_base_someone_else_made_is_left_alone(d: Path) -> None:
    base = d / "tp"
    base.mkdir(mode=0o755)
    os.chown(base, STRANGER, STRANGER)
    shared_memory_base(base)
    assert stat.S_IMODE(base.stat().st_mode) == 0o755
