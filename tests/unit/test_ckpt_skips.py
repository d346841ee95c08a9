"""A slow tier keeps up by skipping: the newest step lands, the skipped ones are counted."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from trainpod.ckpt import Checkpointer
from trainpod.ckpt.skips import SkipTally
from trainpod.ckpt.tiers import FsTier, Meter
from trainpod.testing.wait import wait_until


def test_the_tally_counts_the_steps_a_tier_never_got() -> None:
    t = SkipTally(["scratch", "durable"])
    for step in (1, 2, 3, 4):
        t.offered(step)
    assert t.committed("scratch", 1) == 0 and t.committed("durable", 1) == 0
    assert t.committed("scratch", 4) == 2  # 2 and 3 went nowhere in scratch
    t.offered(5)
    assert t.committed("durable", 5) == 3
    assert t.committed("durable", 5) == 0  # the same commit told twice
    assert t.totals == {"scratch": 2, "durable": 3}
    t.rollback(3)  # a later attempt saves 3 again
    for step in (3, 4):
        t.offered(step)
    assert t.committed("durable", 4) == 1
    assert t.totals == {"scratch": 2, "durable": 4}


class GatedTier(FsTier):
    """A durable tier whose copies wait for ``gate``: a slow store, under the test's control."""

    def __init__(self, root: Path) -> None:
        super().__init__("slow", root, throttled=True, retry=True)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put(self, step: int, src: Path, names: Any, meter: Meter) -> None:
        self.entered.set()
        assert self.gate.wait(30)
        super().put(step, src, names, meter)


def test_the_in_process_copier_skips_to_the_newest_step_and_counts_the_rest(
    tmp_path: Path,
) -> None:
    slow = GatedTier(tmp_path / "slow")
    memory = FsTier("memory", tmp_path / "shm", node="vm", keep=8, sync=False)
    state = {"t": torch.arange(8.0)}
    with Checkpointer(dir=tmp_path / "d", tiers=[memory, slow], every=1) as ck:
        ck.save(1, state)
        assert slow.entered.wait(30)  # the copier is on step 1, held up by the store
        for step in (2, 3, 4):
            ck.save(step, state)
        wait_until(lambda: ck.progress().committed["memory"] == 4, timeout_s=30, what="memory 4")
        slow.gate.set()
        assert ck.wait(30)
        progress = ck.progress()
    assert progress.committed == {"memory": 4, "slow": 4}
    assert progress.steps_skipped == {"slow": 2}  # 2 and 3 never went to the slow tier
    assert sorted(p.name for p in (tmp_path / "slow").iterdir() if p.name.startswith("step")) == [
        "step-0000000001",
        "step-0000000004",
    ]
