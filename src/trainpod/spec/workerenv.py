"""What of an agent's own environment reaches the workers: the spec's ``env_allow``.

A worker's environment is built, never inherited (ADR 0032): the job's own ``env``, the
torchrun contract, trainpod's variables (node, scratch, sockets, devices), and of the
agent's environment only the variables ``env_allow`` names. The agent's environment is that
of whoever ran ``trainpod cluster create`` (or of the controller that replaced a node), so
anything else in it (a token, a cloud key) would reach every user's job.

An entry is a variable name, or a prefix ending in ``*`` (``LC_*``). The default keeps what
a program needs to run as the submitter meant: ``PATH`` (``trainpod submit`` records its own
too), the locale and time zone, ``TERM``, and ``PYTHONPATH`` and ``VIRTUAL_ENV`` (which code
``python`` imports: a venv or a source checkout; drop them from ``env_allow`` where the
cluster's creator's Python path is none of the users' business). ``HOME``, ``USER`` and
``LOGNAME`` are never taken from the agent's environment: they are those of the account the
worker runs as.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Annotated

from pydantic import AfterValidator

DEFAULT_ENV_ALLOW: tuple[str, ...] = (
    "PATH",
    "LANG",
    "LANGUAGE",
    "LC_*",
    "TZ",
    "TERM",
    "PYTHONPATH",
    "VIRTUAL_ENV",
)

#: Never taken from the agent's environment, whatever ``env_allow`` says: the account's.
ACCOUNT_VARS = frozenset({"HOME", "USER", "LOGNAME"})

_ENTRY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?|\*")  # "*" alone: all (the old inheritance)


def _entry(value: str) -> str:
    if not _ENTRY.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a variable name or a prefix ending in '*'; write names like "
            "PATH or LC_* (letters, digits and underscores, not starting with a digit)"
        )
    if value.rstrip("*") in ACCOUNT_VARS:
        raise ValueError(
            f"{value} is always the account's the worker runs as, never the agent's; "
            "remove it from env_allow"
        )
    return value


EnvAllowEntry = Annotated[str, AfterValidator(_entry)]


def allows(allow: Iterable[str], name: str) -> bool:
    """Whether ``name`` is one of ``allow``'s names or starts with one of its prefixes."""
    if name in ACCOUNT_VARS:
        return False
    for entry in allow:
        if entry.endswith("*"):
            if name.startswith(entry[:-1]):
                return True
        elif name == entry:
            return True
    return False


def allowed(env: Mapping[str, str], allow: Iterable[str]) -> dict[str, str]:
    """The variables of ``env`` that ``allow`` lets through, in ``env``'s order."""
    entries = tuple(allow)
    return {k: v for k, v in env.items() if allows(entries, k)}
