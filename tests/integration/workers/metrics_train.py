"""A rank that "trains" until it is killed, reporting what /metrics shows from beacons.

argv: --step-s S. Each step sleeps S seconds, then reports the step with a falling ``loss``
and ``tokens=512`` through ``trainpod.report`` (no collective: each rank runs alone).
"""

from __future__ import annotations

import argparse
import time

import trainpod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-s", type=float, default=0.1)
    args = ap.parse_args()
    step = 0
    while True:
        step += 1
        time.sleep(args.step_s)
        trainpod.report(step, loss=10.0 / (1 + step), tokens=512)


if __name__ == "__main__":
    main()
