"""Prometheus' text format (0.0.4) for the controller's families, fast.

prometheus_client's ``generate_latest`` checks and escapes every label *name* of every
sample (a regular expression per label); at 1,000 nodes of 8 devices that is ~80,000
samples and about 3 s of CPU, three times the scrape budget. Our label names are fixed
and valid, so :func:`render` writes the same bytes without those checks: label values
are escaped as the format requires, values are formatted by prometheus_client's own
``floatToGoString``, label pairs are sorted by name as ``generate_latest`` sorts them. A
test compares the two byte for byte on a real scrape (tests/component/test_metrics.py).

The per-device families (seven samples for each of 8,000 devices at 1,000 nodes) are
:class:`Rows`: label values kept as tuples, each tuple's label text written once per scrape
and shared by every family that carries it, no ``Sample`` object per sample. ``samples``
still gives prometheus_client's objects (built when asked: ``generate_latest``, tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import cast

from prometheus_client.core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_number = cast(Callable[[float], str], floatToGoString)  # untyped in prometheus_client
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TYPES = {"unknown": "untyped", "info": "gauge", "stateset": "gauge"}


def _num(value: float) -> str:
    """``floatToGoString(value)``; its common case (``repr``) without the call."""
    text = repr(float(value))
    dot = text.find(".")
    return text if 0 < dot <= 6 else _number(value)


def _escape(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


class Rows(Metric):
    """A gauge or counter family whose samples are ``(label values, value)`` rows, all with
    the same label names (in that order); :func:`render` writes them without building a
    ``Sample`` each. Counters get ``_total`` on their sample name as prometheus_client's
    ``CounterMetricFamily`` does (pass the name without it)."""

    def __init__(self, name: str, documentation: str, typ: str, labels: Sequence[str]) -> None:
        if typ not in ("gauge", "counter"):
            raise ValueError(f"Rows: a gauge or a counter, not {typ!r}")
        self.rows: list[tuple[tuple[str, ...], float]] = []
        super().__init__(name, documentation, typ)
        self.labels = tuple(labels)
        self.sample_name = f"{name}_total" if typ == "counter" else name

    def add(self, values: tuple[str, ...], value: float) -> None:
        self.rows.append((values, value))

    @property
    def samples(self) -> list[Sample]:
        return [
            Sample(self.sample_name, dict(zip(self.labels, v, strict=True)), value, None, None)
            for v, value in self.rows
        ]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:  # Metric.__init__ sets []; anything else would be lost
            raise AttributeError("Rows: add rows with add(), not samples")

    def text(
        self, out: list[str], labels: dict[tuple[tuple[str, ...], tuple[str, ...]], str]
    ) -> None:
        """Append this family's sample lines; ``labels`` caches label text by (names, values)."""
        names, order = self.labels, sorted(range(len(self.labels)), key=lambda i: self.labels[i])
        name = self.sample_name
        for values, value in self.rows:
            key = (names, values)
            pairs = labels.get(key)
            if pairs is None:
                pairs = labels[key] = ",".join(
                    [f'{names[i]}="{_escape(values[i])}"' for i in order]
                )
            out.append(f"{name}{{{pairs}}} {_num(value)}\n")


def render(families: Iterable[Metric]) -> bytes:
    out: list[str] = []
    label_text: dict[tuple[tuple[str, ...], tuple[str, ...]], str] = {}
    for m in families:
        name = f"{m.name}_total" if m.type == "counter" else m.name
        doc = m.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {_TYPES.get(m.type, m.type)}\n")
        if isinstance(m, Rows):
            m.text(out, label_text)
            continue
        order: tuple[str, ...] | None = None
        for s in m.samples:
            if not s.labels:
                out.append(f"{s.name} {_num(s.value)}\n")
                continue
            if order is None or len(order) != len(s.labels):
                order = tuple(sorted(s.labels))
            labels = s.labels
            pairs = ",".join([f'{k}="{_escape(labels[k])}"' for k in order])
            out.append(f"{s.name}{{{pairs}}} {_num(s.value)}\n")
    return "".join(out).encode("utf-8")
