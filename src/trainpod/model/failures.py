"""An attempt's failure record and a node's repair state: the JSON columns
``attempts.failure`` and ``nodes.repair``, as frozen dataclasses.

Both are flat JSON objects whose keys depend on who wrote them (a rank that exited, the
watchdog, a quarantine, a preemption; a repair requested, begun, deep-checking), so every
field is optional and the mapping is the same for both:

* ``None`` means the key is absent: :meth:`to_json` leaves it out. A key that its writer
  always writes, even as ``null`` (a rank's ``signal``, a hang's ``rank``, a check's
  ``old_agent``), is named in ``nulls``; :meth:`from_json` fills ``nulls`` from the row, so a
  row is written back exactly as it was read.
* Missing keys get their defaults (``None``): old rows load.
* Unknown keys are kept, in ``extra``, and written back: a row rewritten by this version
  (``_note_fault`` rewrites the whole record) loses nothing another version put there.
* Values are not re-validated: only trainpod writes these columns. The one nested record,
  :class:`Classified`, is read when it is a non-empty object; anything else under
  ``classified`` is kept verbatim in ``extra``.
* :meth:`to_json` returns the keys sorted, as the store writes them (``sort_keys``) and as
  the API has always shown them.

``Failure()`` is "no failure recorded" (``{}``), ``RepairState()`` "no repair in progress"
(``{}``); ``empty`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

_META = ("nulls", "extra")


_NAMES: dict[type, tuple[str, ...]] = {}


def _names(cls: type[Failure] | type[RepairState]) -> tuple[str, ...]:
    """The record fields of ``cls`` (not ``nulls``/``extra``), computed once per class:
    ``dataclasses.fields`` is slow enough to dominate listing ten thousand jobs."""
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in fields(cls) if f.name not in _META)
    return names


def _to_json(record: Failure | RepairState) -> dict[str, Any]:
    out: dict[str, Any] = dict(record.extra)
    for name in _names(type(record)):
        value = getattr(record, name)
        if value is None:
            if name in record.nulls:
                out[name] = None
        elif isinstance(value, Classified):
            out[name] = value.to_json()
        elif isinstance(value, tuple):
            out[name] = list(value)
        else:
            out[name] = value
    return dict(sorted(out.items()))


def _split(cls: type[Failure] | type[RepairState], data: dict[str, Any]) -> dict[str, Any]:
    """The constructor's keyword arguments for ``data``: known keys, ``nulls`` and ``extra``."""
    known = _names(cls)
    kw: dict[str, Any] = {}
    nulls: set[str] = set()
    extra: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            extra[key] = value
        elif value is None:
            nulls.add(key)
        elif key == "classified":
            if isinstance(value, dict) and value:
                kw[key] = Classified.from_json(value)
            else:
                extra[key] = value
        elif key == "nodes" and isinstance(value, list):
            kw[key] = tuple(value)
        else:
            kw[key] = value
    return {**kw, "nulls": frozenset(nulls), "extra": extra}


def _normalise_nulls(record: Failure | RepairState) -> None:
    """Keep in ``nulls`` only the fields that are None, so that two records that write the
    same JSON compare equal."""
    nulls = frozenset(n for n in record.nulls if getattr(record, n, 0) is None)
    object.__setattr__(record, "nulls", nulls)


@dataclass(frozen=True)
class Classified:
    """What recovery decided the fault was, once the attempt ended (policy's ``Fault``, as
    plain values: ``kind`` is a ``FaultKind`` value)."""

    kind: str
    reason: str = ""
    nodes: tuple[str, ...] = ()
    signature: str = ""  # what identifies "the same failure" (crash: exit code + last line)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "nodes": list(self.nodes),
            "reason": self.reason,
            "signature": self.signature,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Classified:
        """Missing keys get defaults; unknown keys are ignored (one place writes it whole)."""
        return cls(
            kind=str(data.get("kind", "")),
            reason=data.get("reason", ""),
            nodes=tuple(data.get("nodes", ())),
            signature=data.get("signature", ""),
        )


@dataclass(frozen=True)
class Failure:
    """Why an attempt stopped (``attempts.failure``).

    Written by the judge for the rank that failed first (``rank``, ``node``, ``exit_code``,
    ``signal``, ``lost``, ``log_tail``), by the watchdog for a hang (``reason``, ``fault_at``,
    ``rank``, ``node``, ``nodes``), by a quarantine (``reason``, ``node``, ``nodes``,
    ``fault_at``) and by a preemption (``reason``, ``grace_s``, ``nodes``); then
    ``noted``/``fault_at`` once ``fault_detected`` is recorded and ``classified`` once
    recovery has decided what it was.
    """

    rank: int | None = None
    node: str | None = None
    nodes: tuple[str, ...] | None = None
    exit_code: int | None = None
    signal: int | None = None
    lost: bool | None = None
    log_tail: str | None = None
    reason: str | None = None
    fault_at: float | None = None
    grace_s: float | None = None  # a preemption's grace period for the kill orders
    noted: bool | None = None  # fault_detected has been recorded
    classified: Classified | None = None
    nulls: frozenset[str] = field(default=frozenset(), repr=False)
    """Fields written as ``null`` when they are None (see the module's docstring)."""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Keys this version does not know, kept as read."""

    def __post_init__(self) -> None:
        _normalise_nulls(self)

    @property
    def empty(self) -> bool:
        """Nothing recorded (``{}``)."""
        return not self.to_json()

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Failure:
        return cls(**_split(cls, data))


@dataclass(frozen=True)
class RepairState:
    """A node's repair in progress (``nodes.repair``); ``RepairState()`` (``{}``) is none.

    A quarantine requests one (``requested``, ``kind``, ``since``); beginning it writes
    ``mode``, ``started_at``, ``old_agent`` (null unless a replacement) and ``kind``; the
    deep check adds ``deep_check_id``.
    """

    requested: bool | None = None
    kind: str | None = None  # the FaultKind value that took the node out
    since: float | None = None
    mode: str | None = None  # "replace" or "check"
    started_at: float | None = None
    old_agent: str | None = None  # a replacement: the agent that must stop reporting first
    deep_check_id: str | None = None
    nulls: frozenset[str] = field(default=frozenset(), repr=False)
    """Fields written as ``null`` when they are None (see the module's docstring)."""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Keys this version does not know, kept as read."""

    def __post_init__(self) -> None:
        _normalise_nulls(self)

    @property
    def empty(self) -> bool:
        """No repair in progress (``{}``)."""
        return not self.to_json()

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RepairState:
        return cls(**_split(cls, data))
