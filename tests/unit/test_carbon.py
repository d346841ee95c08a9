"""Carbon intensity: the spec's ``carbon:`` key, resolved from codecarbon's tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainpod.errors import SpecError
from trainpod.spec import carbon
from trainpod.spec.loading import parse_cluster_spec


def spec(tmp_path: Path, **extra: Any) -> Any:
    data = {"name": "x", "instance_groups": [{"name": "w", "count": 1}], **extra}
    return parse_cluster_spec(data, "cluster.yaml", tmp_path)


def test_a_country_comes_from_codecarbons_table(tmp_path: Path) -> None:
    i = spec(tmp_path, carbon={"country": "fra"}).carbon_intensity()
    assert i.g_per_kwh == pytest.approx(56.039)
    assert "France" in i.source and "codecarbon 3.3.2" in i.source
    assert i.grams(3.6e6) == pytest.approx(56.039)  # one kWh


def test_a_cloud_region_with_or_without_its_provider(tmp_path: Path) -> None:
    a = spec(tmp_path, carbon={"region": "gcp:europe-west9"}).carbon_intensity()
    b = spec(tmp_path, carbon={"region": "europe-west9"}).carbon_intensity()
    assert a == b and a.g_per_kwh > 0 and "Paris" in a.source


def test_a_number_and_the_default(tmp_path: Path) -> None:
    assert spec(tmp_path, carbon={"g_per_kwh": 56}).carbon_intensity().g_per_kwh == 56.0
    default = spec(tmp_path).carbon_intensity()
    assert default.g_per_kwh == carbon.WORLD_AVERAGE_G_PER_KWH
    assert "world average" in default.source


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"country": "FRN"}, "carbon.country: no country 'FRN'"),
        ({"country": "FRN"}, "close: IRN, FRO, FRA"),
        ({"region": "mars-1"}, "carbon.region: no cloud region 'mars-1'"),
        ({}, "give exactly one of country, region, g_per_kwh"),
        ({"country": "FRA", "g_per_kwh": 3}, "give exactly one"),
        ({"g_per_kwh": -1}, "carbon.g_per_kwh"),
        ({"kwh": 1}, "carbon.kwh"),
    ],
)
def test_bad_carbon_says_what_and_how_to_fix(
    tmp_path: Path, value: dict[str, Any], says: str
) -> None:
    with pytest.raises(SpecError) as info:
        spec(tmp_path, carbon=value)
    assert says in str(info.value), str(info.value)
    assert "Fix:" in str(info.value)


def test_every_country_in_the_table_has_an_intensity() -> None:
    table = carbon.countries()
    assert len(table) > 200
    assert all(carbon.for_country(code).g_per_kwh >= 0 for code in table)
