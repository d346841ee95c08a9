"""SIGTERM, a grace period, SIGKILL: on real processes, children and strangers, alone and in
process groups, without stealing a child's exit status from its Popen."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from trainpod import procutil

IGNORE_TERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
# Prints "ready" once its signal handling is set up, then sleeps.
SLEEPER = "import sys, time\n{setup}\nprint('ready', flush=True)\ntime.sleep(120)"


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _start(
    spawned: list[subprocess.Popen[str]], setup: str = "", *, new_session: bool = False
) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", SLEEPER.format(setup=setup)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )
    spawned.append(p)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def test_a_child_that_heeds_sigterm_ends_at_once_and_keeps_its_status(
    spawned: list[subprocess.Popen[str]],
) -> None:
    p = _start(spawned)
    t0 = time.monotonic()
    assert procutil.terminate([procutil.Owned(p)], grace_s=30) == []
    assert time.monotonic() - t0 < 10
    assert p.returncode == -signal.SIGTERM  # psutil did not reap it behind the Popen's back


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(
    spawned: list[subprocess.Popen[str]],
) -> None:
    p = _start(spawned, IGNORE_TERM)
    t0 = time.monotonic()
    assert procutil.terminate([procutil.Owned(p)], grace_s=0.5) == []
    assert time.monotonic() - t0 >= 0.5
    assert p.returncode == -signal.SIGKILL


def test_a_stopped_process_is_woken_to_see_sigterm(spawned: list[subprocess.Popen[str]]) -> None:
    p = _start(spawned)
    p.send_signal(signal.SIGSTOP)
    assert procutil.terminate([procutil.Owned(p)], grace_s=30) == []
    assert p.returncode == -signal.SIGTERM


def test_a_process_that_is_not_our_child_is_waited_for_too() -> None:
    # The shell starts the sleeper in the background and exits: init adopts it.
    out = subprocess.run(
        ["/bin/sh", "-c", "sleep 120 >/dev/null 2>&1 & echo $!"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    stranger = psutil.Process(int(out.stdout))
    try:
        assert stranger.ppid() != psutil.Process().pid
        assert procutil.terminate([stranger], grace_s=30) == []
        assert not psutil.pid_exists(stranger.pid) or not stranger.is_running()
    finally:
        if stranger.is_running():
            stranger.kill()


def test_groups_are_killed_whole_even_when_their_leader_heeded_sigterm(
    spawned: list[subprocess.Popen[str]],
) -> None:
    # The leader exits on SIGTERM; the child it leaves in its group ignores SIGTERM.
    setup = (
        "import subprocess\n"
        f"c = subprocess.Popen([sys.executable, '-c', {SLEEPER.format(setup=IGNORE_TERM)!r}],"
        " stdout=subprocess.PIPE, text=True)\n"
        "assert c.stdout.readline() == 'ready\\n'"
    )
    leader = _start(spawned, setup, new_session=True)
    (child,) = psutil.Process(leader.pid).children()
    seen: list[tuple[int, int]] = []
    left = procutil.terminate(
        [procutil.Owned(leader)],
        grace_s=30,
        kill_wait_s=0.0,
        groups=True,
        before_signal=lambda p, sig: seen.append((p.pid, sig)),
    )
    assert left == [] and leader.returncode == -signal.SIGTERM
    assert [s for _, s in seen] == [signal.SIGTERM, signal.SIGCONT, signal.SIGKILL]
    child.wait(10)  # the SIGKILL of the group reached it
