"""Who is calling, and what they may do: principals, the token book and the access policy.

Every API call is made as a :class:`Principal`, resolved from its bearer token by the API's
middleware: the cluster's admin token (the cluster's creator, an admin), the agents' token
(only the agent API), or a user's token issued with ``trainpod users add``. The owner of a
job is the principal that submitted it, never a name the client sends.

The policy is one pure function, :func:`decide`: users see the whole queue but act (cancel,
private logs, shells, allocations) only on their own jobs; admins act on anyone's and alone
manage nodes, users and preemption. :class:`Access` executes it: a refusal raises
:class:`~trainpod.errors.Forbidden` (HTTP 403 with what was refused and why) and is written
to the event log as :class:`~trainpod.model.events.AccessDenied`.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Literal

from trainpod.clock import Clock
from trainpod.errors import Conflict, Forbidden, NotFound
from trainpod.model.events import (
    AccessDenied,
    AuthFailed,
    AuthThrottled,
    TokenIssued,
    TokensRevoked,
)
from trainpod.spec.sharing import UserSpec
from trainpod.store.accounts import Accounts, TokenRow, UserRow, token_hash
from trainpod.store.repo import Store
from trainpod.store.rows import JobRow

PrincipalRole = Literal["admin", "user", "agent"]


@dataclass(frozen=True)
class Principal:
    name: str
    role: PrincipalRole
    team: str | None = None
    account: str | None = None  # the POSIX account the user's work runs as

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


def owned_by(who: Principal) -> dict[str, str | None]:
    """The fields of a job spec its caller owns, whatever the request said."""
    return {"user": who.name, "team": who.team or "", "account": who.account}


AGENT = Principal("agent", "agent")
"""The node agents (the agents' token)."""


def operator(name: str) -> Principal:
    """The holder of the cluster's admin token: its creator, an admin."""
    return Principal(name, "admin")


class Action(str, enum.Enum):
    """What a caller asks to do, as a refusal names it."""

    CANCEL = "cancel"
    HOLD = "hold or release"
    READ_LOGS = "read the logs of"
    SHELL = "open a shell in"
    ALLOC = "run in the allocation of"
    PREEMPT = "preempt"
    MANAGE_NODES = "manage nodes"
    MANAGE_USERS = "manage users"
    INJECT_FAULTS = "inject faults"


_ADMIN_ONLY = {Action.PREEMPT, Action.MANAGE_NODES, Action.MANAGE_USERS, Action.INJECT_FAULTS}


def decide(who: Principal, action: Action, job: JobRow | None = None) -> str | None:
    """Why ``who`` may not do ``action`` (on ``job``); None when they may."""
    if who.is_admin:
        return None
    if who.role == "agent":
        return "the agents' token reaches only the agent API"
    if action in _ADMIN_ONLY:
        return "only an admin may"
    if job is None:
        return None
    owner = job.spec.get("user", "") if isinstance(job.spec, dict) else ""
    if action is Action.READ_LOGS and not (isinstance(job.spec, dict) and job.spec.get("private")):
        return None  # everybody sees the queue, and logs of jobs not marked private
    if owner != who.name:
        return f"it belongs to {owner or 'nobody'}; only its owner or an admin may"
    return None


HIDDEN = "<hidden>"
"""What a job's ``env`` values read as to anyone but its owner and admins."""


def sees_env(who: Principal | None, owner: str) -> bool:
    """Whether ``who`` may read the values of a job's ``env`` (its keys are everyone's, as
    the queue is): its owner and admins may; ``None`` is the controller itself. A token
    passed with ``--env`` is then not readable by everyone who can list jobs. Not a
    refusal: the others get the job with its values hidden, and no event is written."""
    return who is None or who.is_admin or (who.role == "user" and who.name == owner)


@dataclass
class Access:
    """Executes :func:`decide`, keeps the users and the token book."""

    store: Store
    clock: Clock
    lock: threading.RLock
    _by_hash: dict[str, Principal] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.accounts = Accounts(self.store)

    # -- the policy -----------------------------------------------------------------------
    def authorize(self, who: Principal, action: Action, job: JobRow | None = None) -> None:
        """Return if ``who`` may; else record the refusal and raise :class:`Forbidden`."""
        why = decide(who, action, job)
        if why is None:
            return
        target = f" job {job.id}" if job is not None else ""
        with self.lock, self.store.transaction():
            self.store.append(
                self.clock.now(),
                AccessDenied(
                    user=who.name,
                    action=action.value,
                    job_id=job.id if job is not None else None,
                    reason=why,
                ),
            )
        raise Forbidden(f"{who.name} may not {action.value}{target}: {why}")

    def auth_failed(self, failed: AuthFailed, throttled: AuthThrottled | None = None) -> None:
        """Record a refused token and, when it starts one, the throttle of its address (the
        API's :class:`~trainpod.api.throttle.AuthThrottle` decides which to record)."""
        with self.lock, self.store.transaction():
            now = self.clock.now()
            self.store.append(now, failed)
            if throttled is not None:
                self.store.append(now, throttled)

    # -- users and tokens -----------------------------------------------------------------
    def seed(self, users: tuple[UserSpec, ...]) -> None:
        """Make the spec's users known (called at start, under the store's transaction)."""
        now = self.clock.now()
        for u in users:
            self.accounts.upsert_user(
                u.name, team=u.team, role=u.role, account=u.account, source="spec", now=now
            )
        self.reload()

    def reload(self) -> None:
        """Rebuild the token book from the store (after a token is issued or revoked)."""
        users = {u.name: u for u in self.accounts.users()}
        book: dict[str, Principal] = {}
        for digest, name in self.accounts.live_hashes().items():
            u = users.get(name)
            if u is not None:
                role: PrincipalRole = "admin" if u.role == "admin" else "user"
                book[digest] = Principal(u.name, role, u.team, u.account)
        self._by_hash = book

    def principal(self, token: str) -> Principal | None:
        """The user a token belongs to, if it is live. Takes no lock (the book is replaced
        whole), so the API can call it for every request."""
        return self._by_hash.get(token_hash(token))

    def add_user(
        self,
        by: Principal,
        name: str,
        *,
        team: str | None,
        role: str,
        teams: set[str],
    ) -> tuple[UserRow, TokenRow, str]:
        """Issue a token for ``name``, adding the user if the spec did not declare them."""
        self.authorize(by, Action.MANAGE_USERS)
        now = self.clock.now()
        with self.lock, self.store.transaction():
            user = self.accounts.user(name)
            if user is None:
                if teams and team is None and role != "admin":
                    raise Conflict(
                        f"user {name} is not in the cluster spec; give --team (one of: "
                        f"{', '.join(sorted(teams))})"
                    )
                if team is not None and team not in teams:
                    raise NotFound(
                        f"team {team!r} is not in the cluster spec; use one of: "
                        f"{', '.join(sorted(teams)) or '(none declared)'}"
                    )
                self.accounts.upsert_user(
                    name, team=team, role=role, account=None, source="cli", now=now
                )
                user = self.accounts.user(name)
                assert user is not None
            elif team is not None and team != user.team:
                raise Conflict(f"user {name} is in team {user.team}, not {team}")
            token, secret = self.accounts.issue(name, now)
            self.store.append(now, TokenIssued(user=name, token_id=token.id, by=by.name))
            self.reload()
        return user, token, secret

    def revoke(self, by: Principal, name: str, token_id: str | None = None) -> list[str]:
        self.authorize(by, Action.MANAGE_USERS)
        now = self.clock.now()
        with self.lock, self.store.transaction():
            if self.accounts.user(name) is None:
                raise NotFound(f"no user {name!r}; `trainpod users list` shows them")
            ids = self.accounts.revoke(name, now, token_id)
            if token_id is not None and not ids:
                raise NotFound(f"user {name} has no live token {token_id!r}")
            self.store.append(now, TokensRevoked(user=name, token_ids=tuple(ids), by=by.name))
            self.reload()
        return ids

    def users(self, by: Principal) -> list[tuple[UserRow, list[TokenRow]]]:
        self.authorize(by, Action.MANAGE_USERS)
        with self.lock:
            return [(u, self.accounts.tokens(u.name)) for u in self.accounts.users()]
