"""The fast text exposition writes numbers exactly as prometheus_client does."""

from __future__ import annotations

import pytest

from trainpod.telemetry.exposition import _escape, _num, _number

EDGES = [0.0, -0.0, 1.0, -1.0, 0.1, 1e-5, 5e-324, 3.6e6, 2.0**40, 123456789.0, 1234567.5]


@pytest.mark.parametrize(
    "value", [*EDGES, -1234567.5, 1e20, float("inf"), float("-inf"), float("nan")]
)
def test_numbers_match_prometheus_client(value: float) -> None:
    assert _num(value) == _number(value)  # prometheus_client's floatToGoString


def test_label_values_are_escaped() -> None:
    assert _escape('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    assert _escape("plain") == "plain"
