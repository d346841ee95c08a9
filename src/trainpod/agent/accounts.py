"""Running a user's work as their POSIX account, as Slurm runs a job as its submitter.

Where the agent runs as root and the job's owner maps to an account (``users[].account``
in the cluster spec; the lifecycle scripts create the accounts, as on HyperPod), ranks run
with that account's uid, gid and groups, and a fresh environment with its HOME, USER and
LOGNAME: nothing of the agent's own environment (root's) leaks into them, so one user
cannot read another's files through a job. An agent that is not root cannot switch users:
such a rank fails at once with a message saying so, rather than running as the agent.

Not yet: such ranks start cold (the warm-start zygote runs as root), and the agent's
progress-beacon and checkpoint sockets sit in a root-only directory, so their beacons and
memory-tier hand-offs do not reach the agent (opening them needs a peer-credential check,
SO_PEERCRED against the attempt's uid, so no user can report for another's job).
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass

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

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """The environment for a process of this account: ``base`` (the job's and the
        node's variables) over a clean one, never the agent's."""
        clean = {k: os.environ[k] for k in _KEPT if k in os.environ}
        return {
            **clean,
            **base,
            "HOME": self.home,
            "USER": self.name,
            "LOGNAME": self.name,
            "SHELL": self.shell,
        }

    def own(self, path: str | os.PathLike[str]) -> None:
        """Give a directory the agent made for the work (its scratch) to this account."""
        os.chown(path, self.uid, self.gid)


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
