"""Property-based fuzzing of a running controller's HTTP API (schemathesis over its OpenAPI
schema), with each kind of token and with none.

Every generated call is checked for what issue 14 asks of the API: no 5xx, every 4xx a JSON
body that says what was wrong, a refused call (4xx) changes nothing (jobs, nodes, users and
the event log, but for the ``access_denied`` or ``auth_failed`` event a refusal records),
and the controller still answers afterwards. Used by ``tests/fuzz`` (a few examples per
operation) and by ``benchmarks/reliability.py --part fuzz`` (as many as fit in the minutes
given).

Needs the ``dev`` extra (schemathesis); nothing else of trainpod imports this module.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from schemathesis import Case, GenerationMode

SCHEMA_PATH = "/v1/openapi.json"
REFUSAL_EVENTS = frozenset({"access_denied", "auth_failed", "auth_throttled"})
"""Events a refused call may append: the refusal's own record (ADR 0012, ADR 0032)."""
DERIVED = frozenset({"reason", "queue_position"})
"""A queued job's fields that each scheduling pass recomputes (in memory, never stored): they
move on their own after a submission, refused call or not."""
TIMEOUT_S = 20.0


@dataclass
class Tally:
    """What a fuzz run tried and found, per token kind."""

    tried: Counter[str] = field(default_factory=Counter)
    server_errors: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def report(self) -> str:
        kinds = sorted(self.tried)
        rows = [
            f"  {k:<6} tried {self.tried[k]:>6}  refused {self.refused[k]:>6}  "
            f"5xx {self.server_errors[k]:>3}"
            for k in kinds
        ]
        total = (
            f"  total  tried {sum(self.tried.values()):>6}  refused "
            f"{sum(self.refused.values()):>6}  5xx {sum(self.server_errors.values()):>3}"
        )
        return "\n".join([*rows, total, *(f"  problem: {p}" for p in self.problems[:20])])


class State:
    """What a refused call must not change, read with the admin token: jobs, nodes and users
    as a whole, and the event log as what was appended since the last look (less the events
    a refusal itself records)."""

    def __init__(self, admin: httpx.Client) -> None:
        self._admin = admin
        self._last_event = 0
        self.seen = self._read()
        self.new_events()

    def _read(self) -> dict[str, Any]:
        a = self._admin
        return {
            "jobs": [_omit(j, DERIVED) for j in a.get("/v1/jobs", params={"all": True}).json()],
            "nodes": _stable(a.get("/v1/nodes").json()),
            "users": a.get("/v1/users").json(),
        }

    def new_events(self) -> list[dict[str, Any]]:
        """Events appended since the last call, but those a refusal records."""
        events = self._admin.get("/v1/events", params={"after": self._last_event}).json()
        if events:
            self._last_event = max(e["id"] for e in events)
        return [e for e in events if e["kind"] not in REFUSAL_EVENTS]

    def changed(self) -> list[str]:
        """What changed since the last look (and look again)."""
        now = self._read()
        what = [f"{k}: {_delta(self.seen[k], now[k])}" for k in now if now[k] != self.seen[k]]
        self.seen = now
        kinds = sorted({e["kind"] for e in self.new_events()})
        return what + [f"events ({', '.join(kinds)})"] * bool(kinds)


def _delta(before: Any, after: Any) -> str:
    """The first difference between two JSON values, briefly."""
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return next(_delta(b, a) for b, a in zip(before, after, strict=True) if b != a)
    if isinstance(before, dict) and isinstance(after, dict):
        keys = sorted(k for k in {*before, *after} if before.get(k) != after.get(k))
        return "; ".join(f"{k}: {before.get(k)!r:.80} -> {after.get(k)!r:.80}" for k in keys)
    return f"{before!r:.120} -> {after!r:.120}"


def _omit(row: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in keys}


def _stable(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Nodes less what moves on its own (ages and the like, measured at each read)."""
    out = []
    for n in nodes:
        out.append({k: v for k, v in n.items() if not k.endswith(("_age_s", "_s", "_at"))})
    return out


def problem_of(case: Case[Any], response: httpx.Response) -> str | None:
    """What is wrong with the controller's answer to ``case`` (None: nothing)."""
    where = f"{case.method} {case.formatted_path}"
    if response.status_code >= 500:
        return f"{where}: {response.status_code} {response.text[:300]!r}"
    if response.status_code >= 400 and _is_page(response):
        if not response.text.strip():  # the dashboard answers a person: a page that says why
            return f"{where}: {response.status_code} with an empty page"
    elif response.status_code >= 400:
        try:
            body = response.json()
        except ValueError:
            return f"{where}: {response.status_code} without a JSON body: {response.text[:200]!r}"
        if not isinstance(body, dict) or not (body.get("message") or body.get("detail")):
            return f"{where}: {response.status_code} says not what was wrong: {body!r:.200}"
    return None


def _is_page(response: httpx.Response) -> bool:
    """An answer of the dashboard (``/ui``) meant for a browser: HTML or text."""
    path = response.request.url.path
    kind = response.headers.get("content-type", "")
    return (path == "/ui" or path.startswith("/ui/")) and kind.startswith(
        ("text/html", "text/plain")
    )


def _send(http: httpx.Client, case: Case[Any], token: str | None) -> httpx.Response:
    kwargs = case.as_transport_kwargs(base_url=str(http.base_url).rstrip("/"))
    headers = {
        k: v for k, v in (kwargs.get("headers") or {}).items() if k.lower() != "authorization"
    }
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return http.request(
        kwargs["method"],
        kwargs["url"],
        params=kwargs.get("params"),
        headers=headers,  # the schema has no cookies: the dashboard's is never sent
        content=_body(kwargs),
    )


def _body(kwargs: dict[str, Any]) -> bytes | None:
    if "json" in kwargs and kwargs["json"] is not None:
        return json.dumps(kwargs["json"]).encode()
    data = kwargs.get("data")
    if isinstance(data, dict):  # a form (the dashboard's login)
        return urlencode(data, doseq=True).encode()
    if isinstance(data, str):
        return data.encode("utf-8", "surrogateescape")
    return data if isinstance(data, bytes) else None


def fuzz(
    base_url: str,
    tokens: dict[str, str | None],
    admin_token: str,
    *,
    max_examples: int | dict[str, int],
    until: float | None = None,
    alive: Callable[[], bool] | None = None,
) -> Tally:
    """Fuzz every operation of the controller at ``base_url`` with each of ``tokens``
    (kind -> token; None sends none), ``max_examples`` cases each (or per kind: a token
    the middleware refuses before any route needs fewer). With ``until`` (a monotonic
    time), rounds of that over every operation, with new random cases each round, until
    then; without, one round of the same cases every run. ``alive``: whether the
    controller process still runs."""
    tally = Tally()
    headers = {"Authorization": f"Bearer {admin_token}"}
    raw = httpx.get(base_url + SCHEMA_PATH, headers=headers, timeout=TIMEOUT_S)
    raw.raise_for_status()  # the schema too needs a token
    operations = list(_operations(schemathesis.openapi.from_dict(raw.json())))
    with (
        httpx.Client(base_url=base_url, timeout=TIMEOUT_S) as http,
        httpx.Client(base_url=base_url, headers=headers, timeout=TIMEOUT_S) as admin,
    ):
        state = State(admin)
        while True:
            for operation in operations:
                for kind, token in tokens.items():
                    if until is not None and time.monotonic() > until:
                        return tally
                    n = max_examples if isinstance(max_examples, int) else max_examples[kind]
                    _fuzz_one(operation, kind, token, http, state, tally, n, until)
                    if gone := _gone(admin, alive):
                        tally.problems.append(f"the controller {gone} after {operation.label}")
                        return tally
            if until is None:
                return tally


def _gone(admin: httpx.Client, alive: Callable[[], bool] | None) -> str | None:
    """Why the controller is no longer there (None: it answers)."""
    if alive is not None and not alive():
        return "died"
    try:
        ok = admin.get("/v1/cluster").status_code == 200
    except httpx.HTTPError:
        ok = False
    return None if ok else "stopped answering"


def _operations(schema: Any) -> Iterator[Any]:
    for result in schema.get_all_operations():
        yield result.ok()


def _fuzz_one(
    operation: Any,
    kind: str,
    token: str | None,
    http: httpx.Client,
    state: State,
    tally: Tally,
    max_examples: int,
    until: float | None,
) -> None:
    # Cases that fit the schema, and cases that do not (wrong types, missing fields, values
    # out of range): the first probe the controller's own checks, the second FastAPI's.
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        derandomize=until is None,  # CI: the same cases every run
    )
    @given(case=cases)
    def run(case: Case[Any]) -> None:
        if until is not None and time.monotonic() > until:
            return
        try:
            response = _send(http, case, token)
        except httpx.HTTPError as exc:
            tally.problems.append(
                f"[{kind}] {case.method} {case.formatted_path}: no answer: {exc!r}"
            )
            return
        tally.tried[kind] += 1
        if response.status_code >= 500:
            tally.server_errors[kind] += 1
        wrong = problem_of(case, response)
        if wrong is None and 400 <= response.status_code < 500:
            tally.refused[kind] += 1
            if changed := state.changed():
                wrong = (
                    f"{case.method} {case.formatted_path}: refused ({response.status_code}) "
                    f"but changed {', '.join(changed)}"
                )
        elif response.status_code < 400:
            state.changed()  # an accepted call may change anything: look again
        if wrong is not None:
            tally.problems.append(f"[{kind}] {wrong}")

    try:
        run()
    except HypothesisException as exc:  # e.g. an operation no case can be made for
        tally.problems.append(f"[{kind}] {operation.label}: hypothesis: {exc}")
