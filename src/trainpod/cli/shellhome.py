"""What a shell that runs as the caller's POSIX account needs to use trainpod as the caller.

Where this CLI is root and the caller maps to an account, ``trainpod alloc`` and ``trainpod
shell`` start the shell as that account (:mod:`trainpod.cli.interactive`). The CLI inside
it (``trainpod run``, ``submit``, ``jobs``) is then the account's, and the account can read
neither root's cluster record nor the token this CLI was given. As ``srun`` inside
``salloc`` acts as the user who holds the allocation, the shell gets a trainpod home of its
own for the shell's life: a copy of the cluster's record and *the caller's own token* (the
one this CLI authenticated as, which is what made the shell the caller's; never the cluster's
admin token), a directory only the account can enter, removed when the shell ends.

A file, not ``TRAINPOD_TOKEN`` in the shell's environment: a variable is inherited by
every process the shell starts, the ranks of every step included, and lands in whatever
dumps its environment (crash reports, experiment trackers, ``env`` in a job's log); the file
is read by the CLI alone, and only its directory's path is in the environment. See
docs/decisions/0014-interactive-allocations.md.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from trainpod.agent.accounts import RunAs
from trainpod.cli.context import token_for
from trainpod.paths import ClusterPaths, ClusterRecord, read_secret

HOME_ENV = "TRAINPOD_HOME"
CLUSTER_ENV = "TRAINPOD_CLUSTER"


@dataclass
class ShellHome:
    """A private trainpod home for one shell (empty ``env`` where none is needed)."""

    env: dict[str, str] = field(default_factory=dict)
    path: Path | None = None

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)  # fd-based: never follows a link


def shell_home(paths: ClusterPaths, account: RunAs | None) -> ShellHome:
    """The home for a shell that runs as ``account`` (None: the shell is this CLI's user,
    who has its own home already)."""
    if account is None:
        return ShellHome()
    token = token_for(paths)
    if _is_admin_token(paths, token):
        return ShellHome()  # the cluster's admin token is its creator's, never an account's
    record = ClusterRecord.load(paths)
    # A fresh name made by mkdtemp, root's and 0700 until it is handed over: nobody can have
    # put anything inside, so nothing here is written through a link.
    d = Path(tempfile.mkdtemp(prefix=f"trainpod-{account.name}-"))
    try:
        ours = ClusterPaths.of(paths.name, home=d)
        ours.state_dir.mkdir(parents=True)
        record.save(ours.record)
        tokens = d / "tokens"
        tokens.mkdir(mode=0o700)
        fd = os.open(tokens / f"{paths.name}.token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        (d / "current").write_text(paths.name)
        for p in [d, *d.rglob("*")]:
            os.lchown(p, account.uid, account.gid)
            if p.is_dir():
                p.chmod(0o700)
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    return ShellHome({HOME_ENV: str(d), CLUSTER_ENV: paths.name}, d)


def _is_admin_token(paths: ClusterPaths, token: str) -> bool:
    try:
        return read_secret(paths.admin_token) == token
    except OSError:
        return False
