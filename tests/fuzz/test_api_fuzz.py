"""Schemathesis over the controller's OpenAPI schema, against a real controller process on
a local port, with the admin's, a user's and the agents' tokens and with none (issue 14):
no 5xx, the controller still answers, every 4xx is a JSON body that says what was wrong, and
a refused call changes no job, node, user or event (but the refusal's own event).

CI runs a few cases per operation and token (the same ones every run: derandomized);
``TRAINPOD_FUZZ_EXAMPLES=N`` runs N per operation and token, and
``benchmarks/reliability.py --part fuzz --fuzz-minutes M`` runs for M minutes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fuzz.server import controller
from trainpod.testing.apifuzz import fuzz

CI_EXAMPLES = {"admin": 3, "user": 3, "agent": 2, "none": 1}
"""Per operation. The agents' token and no token are refused at the door for all but the
agent API (401/403 before any route runs): fewer cases find as much there."""


def _examples() -> int | dict[str, int]:
    n = os.environ.get("TRAINPOD_FUZZ_EXAMPLES")
    return int(n) if n else CI_EXAMPLES


@pytest.mark.timeout(300)
def test_fuzzed_calls_never_fail_the_controller_and_refusals_change_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINPOD_HOME", str(tmp_path / "home"))
    with controller(tmp_path) as c:
        tally = fuzz(c.url, c.tokens, c.admin, max_examples=_examples(), alive=c.alive)
        print(tally.report())  # shown with -s: requests tried and 5xx seen, by token kind
        assert c.alive(), "the controller process died"
    assert set(tally.tried) == {"admin", "user", "agent", "none"}
    assert sum(tally.tried.values()) >= 100, tally.report()  # the fuzz did run
    assert not tally.problems, tally.report()
    assert sum(tally.server_errors.values()) == 0
