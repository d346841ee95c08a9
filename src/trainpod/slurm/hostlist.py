"""Slurm host lists: ``node[1-3,7]`` <-> ``["node1", "node2", "node3", "node7"]``.

Slurm prints and accepts node sets in this compressed form (``scontrol show hostnames``
expands it). Ranges keep their zero padding (``n[01-03]`` is n01, n02, n03). One bracket
group per name is supported, which covers every name Slurm generates from a NodeName line.
"""

from __future__ import annotations

import re
from itertools import groupby

_TOKEN = re.compile(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)")


class HostlistError(ValueError):
    """A host list that cannot be parsed; the message names the bad part."""


def expand(hostlist: str) -> list[str]:
    """Every host named by ``hostlist``, in order, duplicates dropped."""
    out: list[str] = []
    pos = 0
    text = hostlist.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise HostlistError(f"cannot parse host list {hostlist!r} at {text[pos:]!r}")
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if ranges is None:
            out.append(prefix + suffix)
        else:
            out.extend(f"{prefix}{n}{suffix}" for n in _ranges(ranges, hostlist))
        pos = m.end()
        if pos < len(text):
            if text[pos] != ",":
                raise HostlistError(f"expected ',' in host list {hostlist!r} at {text[pos:]!r}")
            pos += 1
    return list(dict.fromkeys(out))


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
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


_SPLIT = re.compile(r"^(.*?)(\d+)$")


def compress(hosts: list[str]) -> str:
    """The shortest host list for ``hosts`` that :func:`expand` turns back into them.

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
