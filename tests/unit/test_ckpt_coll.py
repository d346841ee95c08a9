"""``Coll.close``: a closed Coll refuses every call, whatever group it had."""

from __future__ import annotations

import pytest

from trainpod.ckpt.coll import Coll, CollClosed


def test_a_closed_coll_refuses_calls_instead_of_acting_alone() -> None:
    trivial = Coll(None, 0, 1)
    assert trivial.all_gather("x") == ["x"] and trivial.bound() is None
    grouped = Coll(object(), 1, 4)  # as if over a real group: never reached once closed
    for coll in (trivial, grouped):
        coll.close("the process group was re-formed")
        assert coll.group is None  # dropped: nothing of ours keeps the old sockets open
        with pytest.raises(CollClosed, match="re-formed"):
            coll.all_gather("x")
        with pytest.raises(CollClosed):
            coll.bound()  # DCP is never told "not distributed" for a closed group
        with pytest.raises(CollClosed):
            coll.barrier()
