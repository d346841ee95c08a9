"""Warm starts: which commands start warm, and a forked rank behaves like a ``Popen`` one.

The plan tests are pure. The others run a real zygote (preloading nothing, so it is ready in
a fraction of a second) behind a real :class:`Launcher`, and compare with cold starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

import psutil
import pytest

from trainpod.agent.launcher import Launcher
from trainpod.agent.ranks import Notice, ignore_notice_signal
from trainpod.agent.warmstart import WarmStarter, agents_zygote_env, plan
from trainpod.agent.zygote import SPARE_NAME, Plan, Spare, Zygote
from trainpod.api.models import LaunchOrder, RankReport, RankSlot
from trainpod.testing.wait import wait_until

PY = sys.executable
BIN = str(Path(PY).parent)
ZENV = {"PATH": BIN, "OMP_NUM_THREADS": "1"}


def _plan(argv: list[str], cwd: Path, **env: str) -> Plan | str:
    return plan(argv, cwd=str(cwd), env={**ZENV, **env}, log="x.log", zygote_env=ZENV)


# -- which commands start warm -----------------------------------------------------------


@pytest.fixture
def script(tmp_path: Path) -> Path:
    (tmp_path / "sub").mkdir()
    s = tmp_path / "sub" / "train.py"
    s.write_text("print('hi')\n")
    return s


def test_bare_names_resolve_on_the_orders_path(tmp_path: Path, script: Path) -> None:
    p = _plan(["python", str(script), "--steps", "3"], tmp_path)
    assert isinstance(p, Plan)
    assert (p.script, p.module, p.unbuffered) == (str(script), None, False)
    assert p.args == ["--steps", "3"]
    assert isinstance(_plan(["python3", str(script)], tmp_path), Plan)
    assert isinstance(_plan([PY, str(script)], tmp_path), Plan)
    assert "not the agent's interpreter" in str(_plan(["python", str(script)], tmp_path, PATH="/"))


def test_module_unbuffered_and_relative_scripts(tmp_path: Path, script: Path) -> None:
    p = _plan(["python", "-u", "-m", "pkg.mod", "a"], tmp_path)
    assert isinstance(p, Plan)
    assert (p.script, p.module, p.args, p.unbuffered) == (None, "pkg.mod", ["a"], True)
    p = _plan(["python", "sub/train.py"], tmp_path)  # relative to the order's cwd
    assert isinstance(p, Plan) and p.script == "sub/train.py"
    assert "not a Python source file" in str(_plan(["python", "train.py"], tmp_path))


COLD = [["bash", "-c", "true"], ["python", "-c", "print(1)"], ["python", "-O", "x.py"]]


@pytest.mark.parametrize("argv", [*COLD, ["python", "-m"], ["python"], []])
def test_other_commands_start_cold(tmp_path: Path, argv: list[str]) -> None:
    assert isinstance(_plan(argv, tmp_path), str)


def test_another_environment_with_the_same_binary_starts_cold(tmp_path: Path, script: Path) -> None:
    # Like a second venv: a link to the same interpreter binary, in another bin dir.
    other = tmp_path / "venv2" / "bin"
    other.mkdir(parents=True)
    (other / "python").symlink_to(os.path.realpath(PY))
    assert isinstance(_plan([str(other / "python"), str(script)], tmp_path), str)


def test_load_time_variables_must_match_the_zygotes(tmp_path: Path, script: Path) -> None:
    argv = ["python", str(script)]
    assert "PYTHONHASHSEED" in str(_plan(argv, tmp_path, PYTHONHASHSEED="0"))
    assert "OMP_NUM_THREADS" in str(_plan(argv, tmp_path, OMP_NUM_THREADS="8"))
    assert "LD_PRELOAD" in str(_plan(argv, tmp_path, LD_PRELOAD="/x.so"))
    # applied in the child, or not read at start-up
    assert isinstance(_plan(argv, tmp_path, PYTHONPATH="/x", PYTHONUNBUFFERED="1"), Plan)
    assert isinstance(_plan(argv, tmp_path, RANK="3", NCCL_DEBUG="INFO"), Plan)
    assert _plan(argv, tmp_path, TRAINPOD_WARM_START="0") == "TRAINPOD_WARM_START=0"


# -- a real zygote -------------------------------------------------------------------------


def starter(
    short: Path,
    env: Mapping[str, str],
    preload: list[str],
    restart_delay_s: float = 1.0,
    later: tuple[str, ...] = (),
    spare: bool = True,
    spare_delay_s: float | None = None,
) -> WarmStarter:
    sock, log = short / "z.sock", short / "z.log"
    w = WarmStarter(
        socket_path=sock,
        log_path=log,
        env=env,
        preload=preload,
        restart_delay_s=restart_delay_s,
        later=later,
        spare=spare,
        spare_delay_s=spare_delay_s,
    )
    w.start()
    return w


@pytest.fixture
def short() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tpz-") as d:  # a socket path must stay short
        yield Path(d)


@pytest.fixture(scope="module")
def warm() -> Iterator[WarmStarter]:
    with tempfile.TemporaryDirectory(prefix="tpz-") as d:
        w = starter(Path(d), agents_zygote_env(), [])
        wait_until(lambda: w.ready, timeout_s=30, what="the zygote")
        yield w
        w.close()


class Run:
    """One launcher, its orders numbered from 1."""

    def __init__(self, warm: WarmStarter | None, workdir: Path, caplog: pytest.LogCaptureFixture):
        caplog.set_level(logging.INFO, logger="trainpod.agent.launcher")
        self.caplog = caplog
        self.launcher = Launcher(node_env={"NODE_VAR": "n"}, on_change=lambda: None, warm=warm)
        self.workdir = workdir
        self.n = 0

    def launch(self, argv: list[str], ranks: int = 1, **env: str) -> int:
        self.n += 1
        path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"  # as the local backend does
        env = {"WORLD_SIZE": str(ranks), "OMP_NUM_THREADS": "1", "PATH": path, **env}
        slots = [RankSlot(rank=r, local_rank=r) for r in range(ranks)]
        order = LaunchOrder(
            attempt_id=self.n,
            job_id=1,
            attempt_number=self.n,
            argv=argv,
            workdir=str(self.workdir),
            env=env,
            ranks=slots,
            log_dir=str(self.workdir / f"attempt-{self.n}"),
        )
        assert self.launcher.launch(order)
        return self.n

    def ranks(self, attempt: int) -> list[RankReport]:
        (rep,) = [a for a in self.launcher.reports() if a.attempt_id == attempt]
        return rep.ranks

    def ended(self, attempt: int, timeout_s: float = 30) -> list[RankReport]:
        def done() -> list[RankReport] | None:
            ranks = self.ranks(attempt)
            return ranks if all(r.state == "exited" for r in ranks) else None

        return wait_until(done, timeout_s=timeout_s, what=f"attempt {attempt} to end")

    def how(self, attempt: int, rank: int = 0) -> str:
        """How the launcher started the rank: "warm start" or "cold start"."""
        prefix = f"rank {rank} of attempt {attempt}: "
        (msg,) = [m for m in self.caplog.messages if m.startswith(prefix)]
        return msg.removeprefix(prefix)[:10]

    def log(self, attempt: int, rank: int = 0) -> str:
        return (self.workdir / f"attempt-{attempt}" / f"rank-{rank}.log").read_text()

    def pid(self, attempt: int, rank: int = 0) -> int:
        pid = self.ranks(attempt)[rank].pid
        assert pid is not None
        return pid

    def wait_log(self, attempt: int, text: str, rank: int = 0) -> None:
        wait_until(lambda: text in self.log(attempt, rank), timeout_s=30, what=repr(text))


@contextlib.contextmanager
def ready_run(w: WarmStarter, workdir: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Run]:
    """A launcher on ``w`` once its zygote is ready; at the end every rank is killed and the
    launcher and the zygote are closed."""
    run = Run(w, workdir, caplog)
    try:
        wait_until(lambda: w.ready, timeout_s=30, what="the zygote")
        yield run
    finally:
        run.launcher.kill_everything()
        run.launcher.shutdown(1)
        w.close()


def ppid(pid: int) -> int:
    return psutil.Process(pid).ppid()


@pytest.fixture
def run(warm: WarmStarter, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Run]:
    r = Run(warm, tmp_path, caplog)
    yield r
    r.launcher.kill_everything()


def write(path: Path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


HOLD = """\
    import os, signal, sys, time
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("holding", os.getpid(), flush=True)
    while True:
        time.sleep(0.01)
"""


@pytest.mark.parametrize(
    ("source", "exit_code", "sig", "last_line"),
    [
        ("print('fine')\n", 0, None, "fine"),
        ("import sys\nsys.exit(3)\n", 3, None, ""),
        ("raise SystemExit('no data')\n", 1, None, "no data"),
        ("def f():\n    1 / 0\nf()\n", 1, None, "ZeroDivisionError: division by zero"),
        ("raise KeyboardInterrupt\n", None, signal.SIGINT, "KeyboardInterrupt"),
    ],
)
def test_exit_status_and_log_as_python_would(
    run: Run, tmp_path: Path, source: str, exit_code: int | None, sig: int | None, last_line: str
) -> None:
    script = write(tmp_path / "s.py", source)
    hot = run.launch(["python", script])
    cold = run.launch(["python", script], TRAINPOD_WARM_START="0")
    assert (run.how(hot), run.how(cold)) == ("warm start", "cold start")
    for attempt in (hot, cold):
        (r,) = run.ended(attempt)
        assert (r.exit_code, r.signal) == (exit_code, sig)
    assert run.log(hot) == run.log(cold)  # tracebacks included: no zygote frames
    assert (run.log(hot).splitlines() or [""])[-1] == last_line


def test_signals_and_teardown(run: Run, warm: WarmStarter, tmp_path: Path) -> None:
    hold = write(tmp_path / "hold.py", HOLD)
    a = run.launch(["python", hold], ranks=2)
    b = run.launch(["python", hold, "--ignore-term"])
    for attempt, rank in ((a, 0), (a, 1), (b, 0)):
        run.wait_log(attempt, "holding", rank)
        assert ppid(run.pid(attempt, rank)) == warm.pid
        assert os.getpgid(run.pid(attempt, rank)) == os.getsid(run.pid(attempt, rank))
    pid = run.pid(a, 0)
    assert run.launcher.signal_rank(0, signal.SIGSTOP) == 0
    stopped = psutil.STATUS_STOPPED
    wait_until(lambda: psutil.Process(pid).status() == stopped, timeout_s=10, what="stopped")
    run.launcher.signal_rank(0, signal.SIGCONT)
    wait_until(lambda: psutil.Process(pid).status() != stopped, timeout_s=10, what="continued")
    run.launcher.kill(a, grace_s=10)
    assert [r.signal for r in run.ended(a)] == [signal.SIGTERM, signal.SIGTERM]
    run.launcher.kill(b, grace_s=0.2)  # it ignores SIGTERM: SIGKILL after the grace
    assert run.ended(b)[0].signal == signal.SIGKILL
    c = run.launch(["python", hold])
    run.wait_log(c, "holding")
    run.launcher.kill_everything()
    assert run.ended(c)[0].signal == signal.SIGKILL


PROBE = """\
    import json, os, signal, sys
    import __main__
    out = {
        "env": dict(os.environ),
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "executable": sys.executable,
        "path": sys.path,
        "cwd": os.getcwd(),
        "file": __main__.__file__,
        "name": __name__,
        "main": sorted(k for k in vars(__main__) if k.startswith("__")),
        "spec": getattr(__spec__, "name", None),
        "signals": {str(s): repr(signal.getsignal(s)) for s in signal.valid_signals()},
        "mask": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "session": os.getsid(0) == os.getpid() == os.getpgid(0),
        "stdin": os.readlink("/proc/self/fd/0"),
        "stdout": [sys.stdout.line_buffering, sys.stdout.write_through, sys.stdout.encoding],
        "stderr": [sys.stderr.line_buffering, sys.stderr.errors],
    }
    out["env"].pop("TRAINPOD_WARM_START", None)
    out["env"].pop("TRAINPOD_NOTICE_FILE", None)  # in the attempt's own dir
    print(json.dumps(out))
"""


@pytest.mark.parametrize("how", ["script", "relative", "module", "unbuffered"])
def test_a_warm_rank_sees_what_a_cold_one_sees(
    run: Run, warm: WarmStarter, tmp_path: Path, how: str
) -> None:
    (tmp_path / "pkg").mkdir()
    write(tmp_path / "pkg" / "probe.py", PROBE)
    argv = {
        "script": ["python", str(tmp_path / "pkg" / "probe.py"), "--x", "1"],
        "relative": ["python", "pkg/probe.py"],
        "module": ["python", "-m", "probe", "a"],  # found through PYTHONPATH
        "unbuffered": [PY, "-u", "pkg/probe.py"],
    }[how]
    env = {"PYTHONPATH": str(tmp_path / "pkg"), "RANK_EXTRA": "x"}
    if how == "unbuffered":
        env["PYTHONUNBUFFERED"] = ""  # -u alone makes it unbuffered
    hot = run.launch(argv, ranks=2, **env)
    cold = run.launch(argv, ranks=2, TRAINPOD_WARM_START="0", **env)
    for rank in (0, 1):
        assert run.ended(hot)[rank].exit_code == 0, run.log(hot, rank)
        assert run.ended(cold)[rank].exit_code == 0, run.log(cold, rank)
        warm_out, cold_out = json.loads(run.log(hot, rank)), json.loads(run.log(cold, rank))
        assert warm_out.keys() == cold_out.keys()
        for k, v in cold_out.items():
            assert (k, warm_out[k]) == (k, v)
        assert warm_out["env"]["RANK"] == str(rank) and warm_out["env"]["NODE_VAR"] == "n"
    assert [run.how(hot, r) for r in (0, 1)] == ["warm start"] * 2
    assert [run.how(cold, r) for r in (0, 1)] == ["cold start"] * 2


def test_threads_atexit_and_multiprocessing_in_a_warm_rank(
    run: Run, warm: WarmStarter, tmp_path: Path
) -> None:
    script = """\
        import atexit, multiprocessing, threading, time

        def square(x):
            return x * x

        def late():
            time.sleep(0.2)
            print("thread done", flush=True)

        if __name__ == "__main__":
            with multiprocessing.Pool(2) as pool:
                print("fork", pool.map(square, range(4)), flush=True)
            with multiprocessing.get_context("spawn").Pool(2) as pool:
                print("spawn", pool.map(square, range(4)), flush=True)
            atexit.register(print, "atexit ran")
            threading.Thread(target=late).start()  # python waits for it before exiting
    """
    a = run.launch(["python", write(tmp_path / "mp.py", script)])
    assert run.how(a) == "warm start"
    assert run.ended(a)[0].exit_code == 0, run.log(a)
    assert run.log(a) == "fork [0, 1, 4, 9]\nspawn [0, 1, 4, 9]\nthread done\natexit ran\n"


def test_the_servers_finalizers_do_not_run_at_a_warm_ranks_exit(
    tmp_path: Path, short: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A preloaded module's weakref.finalize (torch makes one per operator library) belongs to
    # the server: a rank that did not import the module itself would never run it.
    (short / "tp_zfin.py").write_text(
        "import weakref\n"
        "class Lib:\n    pass\n"
        "LIB = Lib()\n"
        "weakref.finalize(LIB, print, 'server finalizer ran')\n"
    )
    path = os.pathsep.join([str(short), *filter(None, [os.environ.get("PYTHONPATH")])])
    w = starter(short, {**agents_zygote_env(), "PYTHONPATH": path}, ["tp_zfin"])
    with ready_run(w, tmp_path, caplog) as run:
        script = """\
            import sys, weakref
            class Mine:
                pass
            mine = Mine()
            weakref.finalize(mine, print, "rank finalizer ran")
            print("preloaded" if "tp_zfin" in sys.modules else "not preloaded", flush=True)
        """
        a = run.launch(["python", write(tmp_path / "fin.py", script)], PYTHONPATH=path)
        assert run.how(a) == "warm start"
        assert run.ended(a)[0].exit_code == 0, run.log(a)
        assert run.log(a) == "preloaded\nrank finalizer ran\n"


def test_a_preloaded_trainpod_reads_the_ranks_environment(
    tmp_path: Path, short: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # trainpod is preloaded by default: its notice and beacon read the environment on their
    # first call, in the rank, so each rank sees its own notice file, not the server's.
    w = starter(
        short, {**agents_zygote_env(), "TRAINPOD_NOTICE_FILE": str(short / "zyg")}, ["trainpod"]
    )
    with ready_run(w, tmp_path, caplog) as run:
        script = """\
            import os, sys
            was = "trainpod" in sys.modules
            import trainpod
            if "--notice" in sys.argv:  # the file the launcher gave this rank
                open(os.environ["TRAINPOD_NOTICE_FILE"], "w").close()
            print(was, trainpod.preempted(), flush=True)
        """
        argv = ["python", write(tmp_path / "n.py", script)]
        a = run.launch([*argv, "--notice"])
        b = run.launch(argv)
        assert (run.how(a), run.how(b)) == ("warm start", "warm start")
        for attempt in (a, b):
            assert run.ended(attempt)[0].exit_code == 0, run.log(attempt)
        assert (run.log(a), run.log(b)) == ("True True\n", "True False\n")


def test_a_dead_zygote_means_cold_starts_until_it_is_back(
    tmp_path: Path, short: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = starter(short, agents_zygote_env(), [], restart_delay_s=3.0)  # room to see a cold start
    run = Run(w, tmp_path, caplog)
    try:
        wait_until(lambda: w.ready, timeout_s=30, what="the zygote")
        hold = write(tmp_path / "hold.py", HOLD + "        if os.path.exists('go'): sys.exit(3)\n")
        first = w.pid
        assert first is not None
        a = run.launch(["python", hold], ranks=2)
        for rank in (0, 1):
            run.wait_log(a, "holding", rank)
            assert ppid(run.pid(a, rank)) == first
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: not w.ready, timeout_s=10, what="the supervisor to notice")
        b = run.launch(["python", write(tmp_path / "ppid.py", "import os; print(os.getppid())")])
        assert run.ended(b)[0].exit_code == 0
        assert run.log(b) == f"{os.getpid()}\n"  # started cold, by us
        assert "(the warm-start server is not ready)" in run.caplog.text
        # ranks the dead zygote started still report their exits, code or signal
        os.kill(run.pid(a, 1), signal.SIGKILL)
        (tmp_path / "go").touch()
        assert [(r.exit_code, r.signal) for r in run.ended(a)] == [(3, None), (None, 9)]
        wait_until(lambda: w.ready and w.pid not in (None, first), timeout_s=30, what="restart")
        c = run.launch(["python", hold])
        assert run.how(c) == "warm start"  # the new zygote
        assert run.ended(c)[0].exit_code == 3  # ("go" is there)
    finally:
        run.launcher.kill_everything()
        run.launcher.shutdown(1)
    assert w.pid is None


def test_the_zygote_refuses_to_fork_with_a_thread_running(tmp_path: Path, short: Path) -> None:
    (short / "spinner.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True)"
        ".start()\n"
    )
    env = {**agents_zygote_env(), "PYTHONPATH": str(short)}
    w = starter(short, env, ["spinner"])
    try:
        wait_until(lambda: w.ready, timeout_s=30, what="the zygote")
        script = write(tmp_path / "ok.py", "print('ok')\n")
        out = w.spawn([PY, script], cwd=str(tmp_path), env=w.env, log_path=tmp_path / "l")
        assert out == (
            "the warm-start server refused: 2 threads run in the warm interpreter; fork is unsafe"
        )
        assert w.pid is not None and waiting_children(w.pid) == []  # no spare forked either
    finally:
        w.close()


def test_modules_imported_later_are_in_the_ranks_forked_after_them(
    tmp_path: Path, short: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent's zygote is ready with torch; dynamo and DCP come after, while it is idle
    (AGENT_WARM_LATER): a rank forked then has them without importing them itself."""
    (short / "warm_one.py").write_text("import time\ntime.sleep(0.3)\n")
    (short / "warm_two.py").write_text("import time\ntime.sleep(0.3)\n")
    env = {**agents_zygote_env(), "PYTHONPATH": str(short)}
    w = starter(short, env, [], later=("warm_one", "warm_two"))
    with ready_run(w, tmp_path, caplog) as run:
        wait_until(
            lambda: "warmed warm_one,warm_two" in (short / "z.log").read_text(),
            timeout_s=30,
            what="the later imports",
        )
        script = "import sys; print(sorted(m for m in sys.modules if m.startswith('warm_')))\n"
        a = run.launch(["python", write(tmp_path / "mods.py", script)])
        assert run.how(a) == "warm start"
        assert run.ended(a)[0].exit_code == 0, run.log(a)
        assert run.log(a) == "['warm_one', 'warm_two']\n"


def test_a_rank_started_during_a_later_import_waits_for_it_warm(
    tmp_path: Path, short: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An import after ready may take longer than the zygote's usual reply time (dynamo took
    10 s on a loaded box): a rank asked for meanwhile waits and starts warm, the zygote is
    not taken for hung and killed."""
    started = short / "importing"
    (short / "warm_slow.py").write_text(
        f"import time\nopen({str(started)!r}, 'w').close()\ntime.sleep(2.0)\n"
    )
    env = {**agents_zygote_env(), "PYTHONPATH": str(short)}
    w = WarmStarter(
        socket_path=short / "z.sock",
        log_path=short / "z.log",
        env=env,
        preload=[],
        later=["warm_slow"],
        reply_timeout_s=0.5,
    )
    w.start()
    with ready_run(w, tmp_path, caplog) as run:
        wait_until(started.exists, timeout_s=30, what="the later import to begin")
        pid = w.pid
        script = "import sys; print('warm_slow' in sys.modules)\n"
        a = run.launch(["python", write(tmp_path / "mods.py", script)])
        assert run.how(a) == "warm start"
        assert run.ended(a)[0].exit_code == 0, run.log(a)
        assert run.log(a) == "True\n"  # forked once the import was done
        assert w.pid == pid  # not killed as hung


def waiting_children(pid: int) -> list[int]:
    """The live children of ``pid`` (of a zygote with no rank running: its spare)."""
    kids = psutil.Process(pid).children()
    return [c.pid for c in kids if c.status() != psutil.STATUS_ZOMBIE]


def test_a_spare_forked_ahead_becomes_the_next_rank_and_another_follows(
    tmp_path: Path, short: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = starter(short, agents_zygote_env(), [])
    with ready_run(w, tmp_path, caplog) as run:
        zygote = w.pid
        assert zygote is not None
        (spare,) = wait_until(lambda: waiting_children(zygote), timeout_s=30, what="a spare")
        # While it waits it is named so (what counts a cluster's processes tells it apart).
        wait_until(lambda: psutil.Process(spare).name() == SPARE_NAME, timeout_s=30, what="name")
        script = (
            "import os; print(os.getpid(), os.getsid(0) == os.getpid(), os.getcwd(),"
            " open('/proc/self/comm').read().strip())\n"
        )
        a = run.launch(["python", write(tmp_path / "me.py", script)], SOME="value")
        assert run.how(a) == "warm start"
        assert run.pid(a) == spare  # no fork on the request's path
        assert run.ended(a)[0].exit_code == 0, run.log(a)
        # Its own session, the order's cwd, the zygote's name back.
        assert run.log(a) == f"{spare} True {tmp_path} {psutil.Process(zygote).name()}\n"
        (second,) = wait_until(
            lambda: [p for p in waiting_children(zygote) if p != spare], timeout_s=30, what="next"
        )
        # A spare killed while it waits is replaced; ranks still start warm.
        os.kill(second, signal.SIGKILL)
        (third,) = wait_until(
            lambda: [p for p in waiting_children(zygote) if p != second],
            timeout_s=30,
            what="a spare after the killed one",
        )
        b = run.launch(
            ["python", write(tmp_path / "env.py", "import os; print(os.environ['SOME'])\n")],
            SOME="other",
        )
        assert run.how(b) == "warm start"
        assert run.pid(b) == third
        assert run.ended(b)[0].exit_code == 0, run.log(b)
        assert run.log(b) == "other\n"


def test_the_next_spare_waits_until_requests_stop_coming(
    tmp_path: Path, short: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not forked while the rank just handed over starts: a request within the delay forks
    on request, and no spare is forked while requests keep coming."""
    w = starter(short, agents_zygote_env(), [], spare_delay_s=600)
    with ready_run(w, tmp_path, caplog) as run:
        zygote = w.pid
        assert zygote is not None
        (spare,) = wait_until(lambda: waiting_children(zygote), timeout_s=30, what="a spare")
        me = write(tmp_path / "me.py", "import os; print(os.getpid())\n")
        a = run.launch(["python", me])
        assert run.pid(a) == spare
        b = run.launch(["python", me])
        assert run.how(b) == "warm start" and run.pid(b) != spare  # forked on request
        for x in (a, b):
            assert run.ended(x)[0].exit_code == 0, run.log(x)
        assert waiting_children(zygote) == []  # the next waits for 600 s without a request


def test_without_a_spare_each_request_forks(
    tmp_path: Path, short: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = starter(short, agents_zygote_env(), [], spare=False)
    with ready_run(w, tmp_path, caplog) as run:
        zygote = w.pid
        assert zygote is not None
        a = run.launch(["python", write(tmp_path / "me.py", "import os; print(os.getpid())\n")])
        assert run.how(a) == "warm start"
        assert run.ended(a)[0].exit_code == 0, run.log(a)
        assert run.log(a) == f"{run.pid(a)}\n"
        assert waiting_children(zygote) == []


@pytest.mark.parametrize("how", ["closed", "killed"])
def test_a_waiting_spare_exits_with_its_zygote(short: Path, how: str) -> None:
    w = starter(short, agents_zygote_env(), [], restart_delay_s=600.0)
    try:
        wait_until(lambda: w.ready, timeout_s=30, what="the zygote")
        zygote = w.pid
        assert zygote is not None
        (spare,) = wait_until(lambda: waiting_children(zygote), timeout_s=30, what="a spare")
        if how == "closed":
            w.close()
        else:
            os.kill(zygote, signal.SIGKILL)

        def gone() -> bool:
            try:
                return psutil.Process(spare).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        wait_until(gone, timeout_s=30, what="the spare to exit")
    finally:
        w.close()


def test_a_spare_that_died_unseen_is_passed_over(tmp_path: Path, short: Path) -> None:
    """A spare that exited but is not reaped yet: the request forks instead of handing its
    plan to nobody (the agent never hears the dead spare's pid)."""
    zygote = Zygote(str(short / "z.sock"), base_path=list(sys.path))
    ours, theirs = socket.socketpair()
    theirs.close()  # what a dead spare leaves
    conn, agent = socket.socketpair()
    p = _plan(["python", write(tmp_path / "x.py", "print('never')\n")], tmp_path)
    assert isinstance(p, Plan)
    try:
        assert zygote._hand_over(Spare(pid=2**22 + 1, sock=ours), conn, p) is False
        assert ours.fileno() == -1  # closed
        agent.setblocking(False)
        with pytest.raises(BlockingIOError):
            agent.recv(1)  # nothing was said to the agent
        assert zygote.children == {}
    finally:
        conn.close()
        agent.close()
        zygote.listener.close()


def test_closing_while_preloading_does_not_wait_for_the_imports(short: Path) -> None:
    (short / "slow.py").write_text("import time\ntime.sleep(600)\n")
    w = starter(short, {**agents_zygote_env(), "PYTHONPATH": str(short)}, ["slow"])
    pid: int = wait_until(lambda: w.pid, timeout_s=30, what="the zygote to start")
    assert not w.ready
    w.close(timeout_s=600)  # would block for 600 s if it waited for the zygote
    assert w.pid is None and not psutil.pid_exists(pid)


NOTICE = """\
    import signal, sys, time
    import trainpod
    ignored = signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    print("started with the notice ignored:", ignored, flush=True)
    if "--listen" in sys.argv:
        trainpod.preempted()  # installs the handler
    print("ready", flush=True)
    while not ("--listen" in sys.argv and trainpod.preempted()):
        time.sleep(0.01)
    print("noticed: saving and exiting", flush=True)
"""


def test_a_notice_then_its_grace_then_teardown_warm_and_cold(
    short: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As under the agent: it ignores the notice signal, so cold ranks and the zygote (and
    its forks) inherit SIG_IGN; a listening script exits on the notice, an ignoring one gets
    the grace, then SIGTERM, and the notice file is there for both."""
    previous = signal.getsignal(signal.SIGUSR1)
    ignore_notice_signal(signal.SIGUSR1)
    w = starter(short, agents_zygote_env(), [])
    try:
        wait_until(lambda: w.ready, timeout_s=30, what="the zygote")
        run = Run(w, tmp_path, caplog)
        script = write(tmp_path / "notice.py", NOTICE)
        cases = {
            (how, mode): run.launch(["python", script, mode], 1, **env)
            for how, env in (("warm start", {}), ("cold start", {"TRAINPOD_WARM_START": "0"}))
            for mode in ("--listen", "--ignore")
        }
        for (how, _mode), attempt in cases.items():
            run.wait_log(attempt, "ready")
            assert run.how(attempt) == how
            assert "started with the notice ignored: True" in run.log(attempt)
        for (_how, mode), attempt in cases.items():
            grace = 60.0 if mode == "--listen" else 0.2  # the listener never needs it all
            run.launcher.kill(attempt, grace_s=30, notice=Notice(signal.SIGUSR1, grace))
        for (how, mode), attempt in cases.items():
            (r,) = run.ended(attempt)
            if mode == "--listen":
                assert (how, r.exit_code, r.signal) == (how, 0, None)
                assert "noticed: saving and exiting" in run.log(attempt)
            else:
                assert (how, r.exit_code, r.signal) == (how, None, signal.SIGTERM)
            notice = json.loads((tmp_path / f"attempt-{attempt}" / "notice-node.json").read_text())
            assert (notice["signal"], notice["reason"]) == ("SIGUSR1", "preempted")
        run.launcher.kill_everything()
    finally:
        w.close()
        signal.signal(signal.SIGUSR1, previous)
