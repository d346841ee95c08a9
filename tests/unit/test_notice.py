"""The preemption flag a script reads: it flips on the notice signal and on the notice file,
and a bad signal name says what to use instead."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

import trainpod
from trainpod.notice import ENV_FILE, ENV_SIGNAL, NoticeWatcher, parse_signal, watcher
from trainpod.testing.wait import wait_until


@pytest.fixture
def make() -> Iterator[list[NoticeWatcher]]:
    made: list[NoticeWatcher] = []
    yield made
    for w in reversed(made):  # our handlers out again, the test process's back
        w.uninstall()


def test_the_flag_flips_on_the_notice_signal(make: list[NoticeWatcher]) -> None:
    w = NoticeWatcher({ENV_SIGNAL: "SIGUSR2"})
    make.append(w)
    assert w.preempted() is False  # the first call installs the handler
    assert w.signal is signal.SIGUSR2
    os.kill(os.getpid(), signal.SIGUSR2)
    wait_until(w.preempted, timeout_s=10, what="the handler to run")
    assert w.preempted() and w.preempted(sync=True)  # it stays; no process group: as is


def test_a_handler_of_the_scripts_own_still_runs(make: list[NoticeWatcher]) -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda s, _f: seen.append(s))
    try:
        w = NoticeWatcher({})
        make.append(w)
        assert not w.preempted()
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_until(w.preempted, timeout_s=10, what="the handler to run")
        assert seen == [signal.SIGUSR1]
        w.uninstall()
        assert signal.getsignal(signal.SIGUSR1) is not w._handle
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_the_notice_file_covers_a_notice_before_any_handler(
    tmp_path: Path, make: list[NoticeWatcher]
) -> None:
    notice = tmp_path / "notice-n0.json"
    w = NoticeWatcher({ENV_FILE: str(notice)})
    make.append(w)
    assert not w.preempted()
    # What the agent writes; the signal came while the handler was not yet installed.
    notice.write_text(json.dumps({"signal": "SIGUSR1", "grace_s": 30, "reason": "preempted"}))
    assert w.preempted()
    notice.unlink()
    assert w.preempted()  # once noticed, always noticed


def test_the_process_wide_flag_is_what_trainpod_and_the_checkpointer_read() -> None:
    assert trainpod.preempted is not None and watcher() is watcher()
    try:
        assert trainpod.preempted() is False  # not under a preempted agent
    finally:
        watcher().uninstall()


@pytest.mark.parametrize(("name", "sig"), [("SIGUSR1", 10), ("usr2", 12), (" HUP ", 1)])
def test_signal_names(name: str, sig: int) -> None:
    assert parse_signal(name) == sig


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("SIGFOO", "'SIGFOO' is not a signal name"),
        ("9", "'9' is not a signal name"),
        ("SIGKILL", "it cannot be caught"),
        ("STOP", "it cannot be caught"),
        ("SIGTERM", "teardown sends it after the grace period"),
        ("SIGSEGV", "it stops or crashes processes"),
        ("SIGCHLD", "child processes send it"),
    ],
)
def test_bad_signal_names_say_what_to_use(name: str, why: str) -> None:
    with pytest.raises(ValueError, match="use one of SIGUSR1, SIGUSR2, SIGHUP") as info:
        parse_signal(name)
    assert why in str(info.value)
