"""Slurm host lists: ``node[1-3,7]`` <-> ``["node1", "node2", "node3", "node7"]``.

Slurm prints and accepts node sets in this compressed form (``scontrol show hostnames``
expands it). Ranges keep their zero padding (``n[01-03]`` is n01, n02, n03). A name may
hold several bracket groups, expanded like Slurm does, the leftmost slowest
(``rack[1-2]-n[01-02]`` is rack1-n01, rack1-n02, rack2-n01, rack2-n02). :func:`compress`
writes one group per name (``rack1-n[01-02],rack2-n[01-02]``), which Slurm reads too.

Not python-hostlist: it does the same, but is GPL-2.0-or-later and trainpod is Apache-2.0.
"""

from __future__ import annotations

import math
import re
from itertools import groupby, product

MAX_HOSTS = 100_000
"""The most hosts one host list may name: a typo such as ``n[1-10000000]`` fails at once."""
_GROUP = re.compile(r"\[([^\]]*)\]")


class HostlistError(ValueError):
    """A host list that cannot be parsed; the message names the bad part."""


def expand(hostlist: str) -> list[str]:
    """Every host named by ``hostlist``, in order, duplicates dropped ("" names none).
    Raises :class:`HostlistError` saying what is wrong where."""
    text = hostlist.strip()
    out: list[str] = []
    for name in _names(text, hostlist) if text else []:
        # literal, ranges, literal, ranges, ..., literal
        choices = [
            [p] if i % 2 == 0 else _ranges(p, hostlist) for i, p in enumerate(_GROUP.split(name))
        ]
        if len(out) + math.prod(len(c) for c in choices) > MAX_HOSTS:
            raise HostlistError(
                f"host list {hostlist!r} names over {MAX_HOSTS} hosts; check the ranges"
            )
        out.extend("".join(parts) for parts in product(*choices))
    return list(dict.fromkeys(out))


def _names(text: str, whole: str) -> list[str]:
    """The comma-separated names of a host list (a comma inside brackets separates ranges)."""
    names: list[str] = []
    start, open_at = 0, None
    for i, ch in enumerate(text):
        if ch == "[":
            if open_at is not None:
                raise HostlistError(f"nested '[' in host list {whole!r} at {text[i:]!r}")
            open_at = i
        elif ch == "]":
            if open_at is None:
                raise HostlistError(f"']' without '[' in host list {whole!r} at {text[i:]!r}")
            open_at = None
        elif ch == "," and open_at is None:
            names.append(text[start:i])
            start = i + 1
    if open_at is not None:
        raise HostlistError(f"unclosed '[' in host list {whole!r} at {text[open_at:]!r}")
    names.append(text[start:])
    if not all(names):
        raise HostlistError(f"empty name in host list {whole!r}; remove the extra ','")
    return names


def _ranges(spec: str, whole: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise HostlistError(f"bad range {part!r} in host list {whole!r}; use e.g. [1-4,7]")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise HostlistError(f"descending range {part!r} in host list {whole!r}")
        if int(hi) - int(lo) >= MAX_HOSTS:
            raise HostlistError(
                f"range {part!r} in host list {whole!r} names over {MAX_HOSTS} hosts"
            )
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


_SPLIT = re.compile(r"^(.*?)(\d+)$")


def compress(hosts: list[str]) -> str:
    """A short host list for ``hosts`` that :func:`expand` turns back into them.

    Names ending in a number are grouped by prefix (and number width when zero-padded);
    the order is prefix, then number."""
    keyed: list[tuple[str, int, int]] = []
    plain: list[str] = []
    for h in dict.fromkeys(hosts):
        m = _SPLIT.match(h)
        if m is None:
            plain.append(h)
            continue
        digits = m.group(2)
        width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0
        keyed.append((m.group(1), width, int(digits)))
    padded = {(p, w) for p, w, _ in keyed if w}
    keyed = [
        (p, len(str(n)) if not w and (p, len(str(n))) in padded else w, n) for p, w, n in keyed
    ]
    parts = list(plain)
    for (prefix, width), group in groupby(sorted(keyed), key=lambda k: (k[0], k[1])):
        nums = [n for _, _, n in group]
        if len(nums) == 1:
            parts.append(f"{prefix}{str(nums[0]).zfill(width)}")
            continue
        runs: list[str] = []
        start = prev = nums[0]
        for n in [*nums[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            a, b = str(start).zfill(width), str(prev).zfill(width)
            runs.append(a if start == prev else f"{a}-{b}")
            if n is not None:
                start = prev = n
        parts.append(f"{prefix}[{','.join(runs)}]")
    return ",".join(parts)
