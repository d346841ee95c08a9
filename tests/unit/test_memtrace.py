"""The controller's tracemalloc hook for soaks: off by default, snapshots on a timer, and
the growth between two snapshots named by the lines that allocated it."""

from __future__ import annotations

import threading
import tracemalloc
from pathlib import Path

import pytest

from trainpod.controller import memtrace
from trainpod.testing.wait import wait_until

HELD: list[bytes] = []


def test_it_is_off_unless_a_directory_is_given(tmp_path: Path) -> None:
    assert memtrace.start_from_env(threading.Event(), env={}) is None
    assert not tracemalloc.is_tracing()


def test_bad_settings_are_refused_with_the_names_of_the_variables(tmp_path: Path) -> None:
    env = {memtrace.DIR_ENV: str(tmp_path), memtrace.EVERY_ENV: "0"}
    with pytest.raises(SystemExit, match=memtrace.EVERY_ENV):
        memtrace.start_from_env(threading.Event(), env=env)


def test_snapshots_on_a_timer_show_which_line_grew(tmp_path: Path) -> None:
    stop = threading.Event()
    tracing: memtrace.Tracing | None = None
    env = {
        memtrace.DIR_ENV: str(tmp_path / "snaps"),
        memtrace.EVERY_ENV: "0.3",
        memtrace.FRAMES_ENV: "1",
    }
    try:
        tracing = memtrace.start_from_env(stop, env=env)
        assert tracing is not None and tracing.dir == tmp_path / "snaps"
        out = tracing.dir
        wait_until(lambda: len(list(out.glob("snapshot-*.tracemalloc"))) >= 1, timeout_s=30)
        first = sorted(out.glob("snapshot-*.tracemalloc"))[0]
        HELD.extend(bytes(1000) + bytes([i % 256]) for i in range(2000))  # ~2 MB that stays
        count = len(list(out.glob("snapshot-*.tracemalloc")))
        wait_until(lambda: len(list(out.glob("snapshot-*.tracemalloc"))) > count, timeout_s=30)
    finally:
        stop.set()
        if tracing is not None:
            tracing.thread.join(30)
        tracemalloc.stop()
    last = sorted(out.glob("snapshot-*.tracemalloc"))[-1]
    top = memtrace.growth(first, last, frames=1, top=3)
    assert top[0].where[0].startswith(__file__)
    assert top[0].size_diff > 1_900_000 and top[0].count_diff >= 1900
    HELD.clear()
