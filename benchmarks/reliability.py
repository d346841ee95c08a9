"""Reliability benchmark (issue 14): a small driver, one function per part.

``--part fuzz``: schemathesis over a real controller's OpenAPI schema (a controller process
of its own on a local port, no agents: nothing fuzzed is ever run as a command) with the
admin's, a user's and the agents' tokens and with none, for ``--fuzz-minutes`` minutes
(random cases; CI's tests/fuzz runs a fixed few). Prints the requests fuzzed, refused and the
5xx seen, by token kind, and every problem found (a 5xx, a 4xx without a JSON reason, a
refused call that changed state, the controller dead or silent). Exit status 1 when any.

    flock /tmp/bench.lock python benchmarks/reliability.py --part fuzz --fuzz-minutes 5

``--part kills``: the controller ``kill -9``'d at random instants under load for
``--kill-minutes`` minutes, the client's ledger audited against the store
(``benchmarks/reliability_kills.py``, which also runs on its own with every knob):

    flock /tmp/bench.lock python benchmarks/reliability.py --part kills --kill-minutes 5

``--part soak``: a local cluster run for ``--soak-minutes`` with a stream of short jobs,
checkpointing GPT jobs and a fault every ~30 s; resources' growth per hour and what was left
at rest (``benchmarks/reliability_soak.py``, which also runs on its own):

    flock /tmp/bench.lock python benchmarks/reliability.py --part soak --soak-minutes 60
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.fuzz.server: the controller without agents


def fuzz_part(args: argparse.Namespace) -> dict[str, object]:
    """Fuzz the API for ``args.fuzz_minutes``; the tally as a dict."""
    from tests.fuzz.server import controller

    from trainpod.testing.apifuzz import fuzz

    with tempfile.TemporaryDirectory(prefix="tp-fuzz-") as tmp:
        os.environ["TRAINPOD_HOME"] = str(Path(tmp) / "home")
        with controller(Path(tmp)) as c:
            start = time.monotonic()
            until = start + args.fuzz_minutes * 60
            n = args.examples
            tally = fuzz(c.url, c.tokens, c.admin, max_examples=n, until=until, alive=c.alive)
            wall = time.monotonic() - start
            alive = c.alive()
    print(f"API fuzz: {args.fuzz_minutes:g} min ({wall:.0f} s), load {os.getloadavg()[0]:.1f}")
    print(tally.report())
    return {
        "minutes": args.fuzz_minutes,
        "wall_s": round(wall, 1),
        "load_1min": round(os.getloadavg()[0], 2),
        "tried": dict(tally.tried),
        "refused": dict(tally.refused),
        "server_errors": dict(tally.server_errors),
        "problems": tally.problems,
        "controller_alive": alive,
    }


def kills_part(args: argparse.Namespace) -> dict[str, object]:
    """The controller killed under load (``benchmarks/reliability_kills.py``)."""
    from benchmarks import reliability_kills

    argv = ["--minutes", str(args.kill_minutes), "--nodes", str(args.nodes)]
    argv += ["--queued", str(args.queued), "--long", str(args.long)]
    argv += ["--fault-every-s", str(args.fault_every_s)]
    rc = reliability_kills.main(argv)
    return {"minutes": args.kill_minutes, "problems": [] if rc == 0 else ["ledger mismatch"]}


def soak_part(args: argparse.Namespace) -> dict[str, object]:
    """A soak (``benchmarks/reliability_soak.py``)."""
    from benchmarks import reliability_soak

    rc = reliability_soak.main(["--minutes", str(args.soak_minutes)])
    return {"minutes": args.soak_minutes, "problems": [] if rc == 0 else ["mismatch or leak"]}


PARTS: dict[str, Callable[[argparse.Namespace], dict[str, object]]] = {
    "fuzz": fuzz_part,
    "kills": kills_part,
    "soak": soak_part,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=sorted(PARTS), action="append", required=True)
    parser.add_argument("--fuzz-minutes", type=float, default=2.0)
    parser.add_argument(
        "--examples", type=int, default=20, help="cases per operation and token, each round"
    )
    parser.add_argument("--kill-minutes", type=float, default=2.0)
    parser.add_argument("--soak-minutes", type=float, default=60.0)
    parser.add_argument("--nodes", type=int, default=8, help="kills: local nodes")
    parser.add_argument("--queued", type=int, default=1000, help="kills: jobs kept queued")
    parser.add_argument("--long", type=int, default=3, help="kills: long-running jobs")
    parser.add_argument(
        "--fault-every-s", type=float, default=5.0, help="kills: a kill-worker this often (0: none)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    results = {part: PARTS[part](args) for part in args.part}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    bad = any(r.get("problems") or r.get("server_errors") for r in results.values())
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
