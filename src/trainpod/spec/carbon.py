"""Carbon intensity of a cluster's electricity: ``carbon:`` in the cluster spec.

One of ``country`` (ISO 3166-1 alpha-3, as codecarbon's table keys it), ``region`` (a cloud
region, ``gcp:europe-west9``) or ``g_per_kwh`` (a number you trust more). The tables are
codecarbon 3.3.2's, copied unchanged into ``trainpod/data/codecarbon`` (read with
:mod:`importlib.resources`; codecarbon itself is not a dependency, see
docs/decisions/0019-energy-and-carbon-intensity.md). Without ``carbon:``, codecarbon's own
last resort applies: the world average, 475 gCO2e/kWh.

CO2e = energy (kWh) x intensity (g/kWh), codecarbon's method.
"""

from __future__ import annotations

import csv
import difflib
import functools
import io
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

CODECARBON_VERSION = "3.3.2"
WORLD_AVERAGE_G_PER_KWH = 475.0  # codecarbon's fallback (IEA, 2019)
J_PER_KWH = 3.6e6


@dataclass(frozen=True)
class Intensity:
    g_per_kwh: float
    source: str
    """Where the figure comes from, for people (``trainpod show``, the metrics' help)."""

    def grams(self, joules: float) -> float:
        return joules / J_PER_KWH * self.g_per_kwh


class UnknownArea(ValueError):
    """A country or region that is not in the tables; the message says what is."""


def _data(name: str) -> str:
    return resources.files("trainpod").joinpath("data", "codecarbon", name).read_text("utf-8-sig")


@functools.lru_cache(maxsize=1)
def countries() -> dict[str, dict[str, Any]]:
    """ISO alpha-3 code -> codecarbon's entry (``carbon_intensity`` g/kWh, ``country_name``,
    ``year``, TWh per source)."""
    data: dict[str, dict[str, Any]] = json.loads(_data("global_energy_mix.json"))
    return data


@functools.lru_cache(maxsize=1)
def regions() -> dict[str, dict[str, str]]:
    """``provider:region`` -> codecarbon's cloud row (``impact`` g/kWh, ``country_name``...)."""
    rows = csv.DictReader(io.StringIO(_data("cloud_impact.csv")))
    return {f"{r['provider']}:{r['region']}": r for r in rows}


def for_country(code: str) -> Intensity:
    key = code.upper()
    entry = countries().get(key)
    if entry is None:
        near = difflib.get_close_matches(key, list(countries()), n=3, cutoff=0.5)
        hint = f" (close: {', '.join(near)})" if near else ""
        raise UnknownArea(
            f"no country {code!r} in codecarbon {CODECARBON_VERSION}'s table{hint}; use an "
            f"ISO 3166-1 alpha-3 code such as FRA, DEU or USA ({len(countries())} are known)"
        )
    return Intensity(
        float(entry["carbon_intensity"]),
        f"{entry['country_name']} ({key}), {entry.get('year', '?')}: codecarbon "
        f"{CODECARBON_VERSION} global_energy_mix (Our World in Data)",
    )


def for_region(name: str) -> Intensity:
    table = regions()
    key = name if ":" in name else next((k for k in table if k.split(":", 1)[1] == name), name)
    row = table.get(key)
    if row is None:
        near = difflib.get_close_matches(key, list(table), n=3, cutoff=0.6)
        hint = f" (close: {', '.join(near)})" if near else ""
        raise UnknownArea(
            f"no cloud region {name!r} in codecarbon {CODECARBON_VERSION}'s table{hint}; "
            f"use provider:region, one of {len(table)} such as gcp:europe-west9"
        )
    return Intensity(
        float(row["impact"]),
        f"{key} ({row['city'] or row['country_name']}): codecarbon {CODECARBON_VERSION} "
        "cloud impact table",
    )


def world_average() -> Intensity:
    return Intensity(
        WORLD_AVERAGE_G_PER_KWH,
        "world average (no carbon: in the spec; codecarbon's fallback, IEA 2019)",
    )
