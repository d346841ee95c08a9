"""Idempotency keys: a creating call sent again with the same ``Idempotency-Key`` makes
nothing new and answers with what the first call made (ADR 0037, after the IETF draft "The
Idempotency-Key HTTP Header Field").

A key is its caller's: the same key from two users is two keys. It is kept
:data:`KEY_TTL_S` from the first call. The same key with the same request (the parsed body,
so field order, spacing and defaults written out do not matter) gives the first call's job;
with another request, :class:`~trainpod.errors.IdempotencyKeyReused` naming the key and the
fields that differ. Only a call that made something is remembered: a refused call (a bad
spec, a full disk) leaves the key free, and its retry is tried afresh.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from trainpod.errors import IdempotencyKeyInvalid, IdempotencyKeyReused
from trainpod.spec.job import JobSpec
from trainpod.store.idempotency import IdempotencyKeys, KeyRow
from trainpod.store.repo import Store
from trainpod.store.secrets import MASKED

HEADER = "Idempotency-Key"
KEY_MAX = 255
"""The longest key, in characters (a UUID, what the client sends, is 36)."""
KEY_TTL_S = 24 * 3600.0
"""How long a key is kept after its first call: a retry later than that makes a new job."""
_KEY = re.compile(r"[!#-\[\]-~]+")  # visible ASCII but the quote and the backslash
_SHOWN = 40  # characters of a value shown in an error


def parse_key(value: str) -> str:
    """The key of an ``Idempotency-Key`` header: a bare token, or the draft's Structured
    Field string (``"8e03978e-..."``), 1 to :data:`KEY_MAX` visible ASCII characters without
    spaces, quotes or backslashes. Anything else raises :class:`IdempotencyKeyInvalid`."""
    raw = value.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        raw = raw[1:-1]
    if 0 < len(raw) <= KEY_MAX and _KEY.fullmatch(raw):
        return raw
    shown = repr(raw[:_SHOWN]) + ("..." if len(raw) > _SHOWN else "")
    raise IdempotencyKeyInvalid(
        f"{HEADER} {shown} ({len(raw)} characters) is not a key: send 1 to {KEY_MAX} visible "
        'ASCII characters without spaces, quotes (") or backslashes, e.g. a UUID '
        "(`python -c 'import uuid; print(uuid.uuid4())'`)"
    )


@dataclass(frozen=True)
class Request:
    """What a keyed call asked for: its operation and its body as JSON values."""

    operation: str
    body: dict[str, Any]
    secret_fields: tuple[str, ...] = ()
    """Fields of ``body`` whose values are secret: stored masked, compared by digest."""

    @classmethod
    def submit(cls, spec: JobSpec) -> Request:
        return cls("submit", spec.model_dump(mode="json"), ("secret_env",))

    def masked(self) -> dict[str, Any]:
        out = dict(self.body)
        for f in self.secret_fields:
            if isinstance(out.get(f), dict):
                out[f] = dict.fromkeys(out[f], MASKED)
        return out

    def fingerprint(self, salt: str) -> str:
        digest = hashlib.sha256((salt + _canonical(self.body)).encode()).hexdigest()
        return f"{salt}:{digest}"


class Replays:
    """Looks keys up and remembers them, inside the caller's transaction."""

    def __init__(self, store: Store, ttl_s: float = KEY_TTL_S) -> None:
        self._keys = IdempotencyKeys(store)
        self.ttl_s = ttl_s

    def made(self, owner: str, key: str, request: Request, now: float) -> int | None:
        """What ``owner``'s first call with ``key`` made, if it asked for ``request``; None
        when the key is new (or expired). Raises :class:`IdempotencyKeyReused` when the first
        call asked for something else."""
        row = self._keys.find(owner, key, now - self.ttl_s)
        if row is None:
            return None
        if row.operation != request.operation:
            raise IdempotencyKeyReused(
                f"{HEADER} {key!r} was first used to {row.operation} (it made {row.made}), "
                f"not to {request.operation}: send a new key for this call"
            )
        salt = row.fingerprint.split(":", 1)[0]
        if request.fingerprint(salt) == row.fingerprint:
            return row.made
        differs = _differences(json.loads(row.request), request.masked(), request.secret_fields)
        raise IdempotencyKeyReused(
            f"{HEADER} {key!r} was first used {_age(now - row.created_at)} ago, for job "
            f"{row.made}, with another request: {differs}. Send the same request to get job "
            f"{row.made} again, or a new key for a new job"
        )

    def remember(self, owner: str, key: str, request: Request, made: int, now: float) -> None:
        """Keep ``key`` as ``owner``'s call that made ``made``; forget expired keys."""
        self._keys.prune(now - self.ttl_s)
        self._keys.put(
            KeyRow(
                owner=owner,
                key=key,
                operation=request.operation,
                made=made,
                request=_canonical(request.masked()),
                fingerprint=request.fingerprint(secrets.token_hex(8)),
                created_at=now,
            )
        )


def _canonical(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _differences(first: dict[str, Any], now: dict[str, Any], secret: tuple[str, ...]) -> str:
    """The fields that differ, said shortly: env and secret values by name only."""
    said = []
    for field in sorted(set(first) | set(now)):
        a, b = first.get(field), now.get(field)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict) and (field == "env" or field in secret):
            names = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            said.append(f"{field} {', '.join(names)}")
        else:
            said.append(f"{field} {_short(a)} then {_short(b)}")
    if not said:  # the masked bodies agree: a secret value changed
        return f"the values of {', '.join(secret)} differ (not shown)"
    return "; ".join(said)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
