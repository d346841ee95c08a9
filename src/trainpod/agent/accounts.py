"""Running a user's work as their POSIX account, as Slurm runs a job as its submitter.

Where the agent runs as root and the job's owner maps to an account (``users[].account``
in the cluster spec; the lifecycle scripts create the accounts, as on HyperPod), ranks run
with that account's uid, gid and groups, and a fresh environment with its HOME, USER and
LOGNAME: nothing of the agent's own environment (root's) leaks into them, so one user
cannot read another's files through a job. An agent that is not root cannot switch users:
such a rank fails at once with a message saying so, rather than running as the agent.

Such ranks start cold (the warm-start zygote runs as root). They reach the agent's
progress-beacon and checkpoint sockets through a directory of their account's own
(:mod:`trainpod.agent.jobsockets`); the agent checks every connection's peer with
``SO_PEERCRED`` (:mod:`trainpod.agent.unixsock`) and, with :class:`Grants`, that an account
speaks only for the attempts and jobs that run as it on this node.
"""

from __future__ import annotations

import os
import pwd
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from trainpod.agent.unixsock import trusted_uids

# What a rank keeps of the agent's environment when it runs as another account.
_KEPT = ("PATH", "LANG", "LC_ALL", "TZ", "TERM")


class AccountError(Exception):
    """The work cannot run as its account (no such account, the agent is not root)."""


@dataclass(frozen=True)
class RunAs:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    shell: str

    def env(self, base: dict[str, str], *, kept: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for a process of this account: ``base`` (the job's and the
        node's variables) over a clean one, never the agent's. ``kept``: what of the
        agent's environment to keep (a rank's: the spec's ``env_allow``); None: PATH, LANG,
        LC_ALL, TZ and TERM."""
        if kept is None:
            kept = {k: os.environ[k] for k in _KEPT if k in os.environ}
        clean = {k: v for k, v in kept.items() if k not in ("HOME", "USER", "LOGNAME", "SHELL")}
        return {
            **clean,
            **base,
            "HOME": self.home,
            "USER": self.name,
            "LOGNAME": self.name,
            "SHELL": self.shell,
        }

    def own(self, path: str | os.PathLike[str], *, private: bool = False) -> None:
        """Give a directory the agent made for the work to this account; ``private``: mode
        0700 too, whatever the agent's umask made it (a job's scratch: another account must
        not read its checkpoints or data; root, the agent, still can)."""
        os.chown(path, self.uid, self.gid)
        if private:
            os.chmod(path, 0o700)


def run_as(account: str) -> RunAs:
    """The account ``account`` as the agent can switch to it; AccountError says why not."""
    if os.geteuid() != 0:
        raise AccountError(
            f"cannot run as account {account!r}: the agent is not root (uid {os.geteuid()}); "
            "run the agents as root to separate users, or remove `account:` from the user"
        )
    try:
        pw = pwd.getpwnam(account)
    except KeyError:
        raise AccountError(
            f"no POSIX account {account!r} on this node; create it (the lifecycle scripts "
            "are the place: useradd) or fix the user's `account:` in the cluster spec"
        ) from None
    groups = tuple(g for g in os.getgrouplist(pw.pw_name, pw.pw_gid) if g != pw.pw_gid)
    return RunAs(pw.pw_name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir, pw.pw_shell or "/bin/sh")


def owns(path: str | os.PathLike[str], uid: int) -> bool:
    """Whether ``path`` is a directory (not a link to one) that belongs to ``uid``."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


class Grants:
    """Which attempts and jobs each account's ranks on this node may speak for: the launcher
    grants them when it starts a rank as an account; the beacon and checkpoint servers ask
    before they book what a connection of that uid says. Root and the agent's own user may
    speak for anything. Thread-safe. Grants are ints and stay for the agent's life."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trusted = trusted_uids()
        self._attempts: dict[int, set[int]] = {}
        self._jobs: dict[int, set[int]] = {}
        self._accounts: dict[int, RunAs] = {}

    def grant(self, account: RunAs, *, attempt_id: int, job_id: int) -> None:
        with self._lock:
            self._accounts[account.uid] = account
            self._attempts.setdefault(account.uid, set()).add(attempt_id)
            self._jobs.setdefault(account.uid, set()).add(job_id)

    def trusted(self, uid: int) -> bool:
        return uid in self._trusted

    def may_report(self, uid: int, attempt_id: int) -> bool:
        """Whether a process of ``uid`` may send beacons for ``attempt_id``."""
        if uid in self._trusted:
            return True
        with self._lock:
            return attempt_id in self._attempts.get(uid, ())

    def may_checkpoint(self, uid: int, job_id: int | None) -> bool:
        """Whether a process of ``uid`` may hand over checkpoints of ``job_id``."""
        if uid in self._trusted:
            return True
        with self._lock:
            return job_id is not None and job_id in self._jobs.get(uid, ())

    def account(self, uid: int) -> RunAs | None:
        """The account of ``uid`` if some rank ran as it here (None: root, the agent, or a
        stranger)."""
        with self._lock:
            return self._accounts.get(uid)
