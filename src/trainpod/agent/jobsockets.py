"""The agent's sockets as the ranks of a job that runs as a POSIX account reach them.

The agent's beacon and checkpoint sockets live in its runtime directory, 0700 and root's. A
rank that runs as an account (:mod:`trainpod.agent.accounts`) gets its own pair instead, in
``<runtime dir>/u<uid>/``: a directory given to that account, mode 0700, so no other account
can even reach the sockets in it; the runtime directory itself becomes 0711 (enter, not
list) so the account can reach its own. The sockets are extra listeners of the same servers,
which admit only root, the agent and that uid (``SO_PEERCRED``, see
:mod:`trainpod.agent.unixsock`), and book only what that uid may say (:class:`Grants`: the
attempts and jobs the launcher started as it here). A rank learns its pair from
``TRAINPOD_BEACON_SOCKET`` and ``TRAINPOD_CKPT_SOCKET`` as every rank does.

The shared-memory base of checkpoint memory tiers (``/dev/shm/trainpod``) is made like
``/tmp`` (root's, 1777): every account can make its job's directory there and nobody can
remove another's.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
from pathlib import Path

from trainpod.agent.accounts import Grants, RunAs
from trainpod.agent.beacons import BeaconServer
from trainpod.agent.persisters import CheckpointHub
from trainpod.beacon import SOCKET_ENV as BEACON_ENV
from trainpod.ckpt.handoff import SOCKET_ENV as CKPT_ENV
from trainpod.ckpt.layout import SHM_ROOT
from trainpod.errors import Fatal

log = logging.getLogger(__name__)


class AccountSockets:
    """Opens, once per account, its beacon and checkpoint sockets on this node.

    ``base``: the agent's runtime directory (its own; refused otherwise). ``memory_base``:
    where memory tiers live (default: as :func:`trainpod.ckpt.layout.resolve` picks it).
    """

    def __init__(
        self,
        base: Path,
        node: str,
        *,
        beacons: BeaconServer,
        checkpoints: CheckpointHub,
        grants: Grants,
        memory_base: Path | None = None,
    ) -> None:
        self.base = Path(base)
        self.node = node
        self.grants = grants
        self._beacons = beacons
        self._checkpoints = checkpoints
        self._memory_base = memory_base or default_memory_base()
        self._lock = threading.Lock()
        self._dirs: dict[int, Path] = {}

    def env_for(self, account: RunAs, *, attempt_id: int, job_id: int) -> dict[str, str]:
        """Grant ``account`` the attempt and job, open its sockets if they are not yet, and
        return the variables that point its ranks at them. Raises :class:`Fatal` (with the
        fix) when a directory on the way is not the agent's."""
        self.grants.grant(account, attempt_id=attempt_id, job_id=job_id)
        with self._lock:
            d = self._dirs.get(account.uid)
            if d is None:
                d = self._open(account)
                self._dirs[account.uid] = d
        return {
            BEACON_ENV: str(d / f"{self.node}.sock"),
            CKPT_ENV: str(d / f"{self.node}.ckpt.sock"),
        }

    def _open(self, account: RunAs) -> Path:
        _own_dir(self.base, 0o711)
        d = self.base / f"u{account.uid}"
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
        st = d.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (os.geteuid(), account.uid):
            raise Fatal(
                f"{d} is not a directory of the agent's or of {account.name}'s; remove it "
                "(the agent makes it for that account's sockets)"
            )
        os.chown(d, account.uid, account.gid)
        os.chmod(d, 0o700)
        self._beacons.add_listener(d / f"{self.node}.sock", uid=account.uid, gid=account.gid)
        self._checkpoints.add_listener(
            d / f"{self.node}.ckpt.sock", uid=account.uid, gid=account.gid
        )
        shared_memory_base(self._memory_base)
        log.info("sockets for account %s (uid %d) in %s", account.name, account.uid, d)
        return d


def default_memory_base() -> Path:
    """Where memory tiers live on this host, as :func:`trainpod.ckpt.layout.resolve` picks."""
    root = SHM_ROOT if SHM_ROOT.is_dir() else Path(tempfile.gettempdir()) / "trainpod-shm"
    return root / "trainpod"


def shared_memory_base(base: Path) -> None:
    """Make ``base`` a directory every account may make its own entries in and nobody may
    remove another's from (root's, mode 1777, like /tmp). One another user made first is
    left alone, with a warning: accounts' memory tiers may then fail there."""
    base.parent.mkdir(mode=0o1777, parents=True, exist_ok=True)
    try:
        base.mkdir()
    except FileExistsError:
        pass
    st = base.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        log.warning(
            "%s belongs to uid %d, not the agent: other accounts' checkpoint memory tiers may "
            "fail there; remove it so the agent makes it shared (mode 1777)",
            base,
            st.st_uid,
        )
        return
    os.chmod(base, 0o1777)


def _own_dir(path: Path, mode: int) -> None:
    """Set ``path``'s mode, once it is sure to be the agent's own directory."""
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise Fatal(
            f"the agent's runtime dir {path} is not its own directory (uid {st.st_uid}); "
            "remove it and start the agent again"
        )
    os.chmod(path, mode)
