"""The warm-start server (a zygote): ``python -m trainpod.agent.zygote --socket PATH``.

One per agent. It imports the ``--preload`` modules once (torch: ~2 s), then serves requests
on a Unix stream socket, one connection per rank; once ready, it imports the ``--later``
modules one by one while no request waits (a request that comes meanwhile waits for the
import under way, which its rank would otherwise have run itself). A request is a
:class:`Plan` (one JSON line); the zygote forks, the child becomes the rank (its own
session, stdio on the rank's log, the order's cwd, environment and argv) and runs the script
as ``python`` would. Once every import is done it keeps one child forked ahead (a *spare*,
detached, waiting on a socket pair), so a request costs no fork: the spare gets the plan and
the request's connection (``SCM_RIGHTS``) and becomes the rank, and the next spare is forked
once no request came for :data:`SPARE_DELAY_S` (a fork of an interpreter holding torch took
5-8 ms on a quiet 2-core box; Android's zygote keeps such a pool for the same reason). A spare
left waiting exits when the server closes its end; while it waits its name is
``trainpod-spare`` (``ps``, ``/proc/PID/comm``: what counts the processes a cluster holds
tells it from a leak), and the rank gets the server's name back. The reply is
``{"pid": N}`` (or ``{"error": why}``: the agent then starts the rank cold), and when the
child ends, ``{"exit_code": C}`` or ``{"signal": S}`` on the same connection.

Contract of the child, so that a warm rank is indistinguishable from a cold one:

* it is in its own session before its pid is sent (``killpg`` works at once), and it starts
  the script only once the pid has been sent (a rank the agent never heard of never runs);
* signal dispositions are those this interpreter started with, the signal mask is empty;
* ``os.environ`` is exactly the order's, ``sys.argv``/``sys.path``/``__main__`` are what
  ``python [-u] script`` or ``python [-u] -m module`` would have made; ``random``, torch's
  CPU generator, NumPy's global state and the multiprocessing authkey are re-seeded;
* the exit status follows ``SystemExit``, an uncaught exception (traceback in the log,
  status 1) or ``KeyboardInterrupt`` (death by SIGINT), after non-daemon threads and
  ``atexit`` handlers ran. The child also writes its own status on the connection before
  exiting, so the agent still learns it if this server has died meanwhile. The
  ``weakref.finalize`` objects it inherited are the server's, not the rank's: they do not
  run at the rank's exit (torch makes one per operator library, 134 of them, and running
  them took ~40 ms of every warm rank's exit on a quiet box; a rank that never imported
  those modules would not run them either, and a ``TemporaryDirectory`` of the server's
  is not the rank's to remove). Those the rank makes run as usual.

Variables read at interpreter start or preload time (``PYTHON*``, ``OMP_*``, ``LD_*`` ...)
cannot change after the fact: the agent sends a rank whose values differ to a cold start.
The zygote never initialises CUDA nor starts a thread, and refuses to fork if one runs.
Stdlib imports only here: whatever this module imports, every rank has imported.
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import contextlib
import gc
import importlib
import importlib.machinery
import io
import json
import os
import random
import runpy
import select
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

REQUEST_TIMEOUT_S = 5.0
SPARE_DELAY_S = 0.2
"""The next spare is forked once no request came for this long: not while the rank just
handed over starts (a fork of an interpreter holding torch and the child's detaching take
~10 ms of CPU, which on a small box the new rank and its gang's would wait for). A burst of
requests (a node's ranks) forks on request after the first, as without a spare."""
READY = b"ready"
WARMING = b"warming"
"""Said before READY when ``--later`` modules follow: until WARMED a request may wait for
an import under way (seconds), so the agent waits longer for its reply."""
WARMED = b"warmed"


@dataclass(frozen=True)
class Plan:
    """How to start one rank: exactly one of ``script`` and ``module`` is set."""

    argv: list[str]
    executable: str  # argv[0] as the interpreter would find it: its sys.executable
    cwd: str
    env: dict[str, str]
    log: str
    script: str | None
    module: str | None
    args: list[str]
    unbuffered: bool

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def from_json(cls, line: bytes) -> Plan:
        return cls(**json.loads(line))


@dataclass(frozen=True)
class Spare:
    """A child forked ahead of the next request (pid), detached, waiting on ``sock``."""

    pid: int
    sock: socket.socket


# -- the server ---------------------------------------------------------------------------


class Zygote:
    def __init__(
        self,
        socket_path: str,
        base_path: list[str],
        spare: bool = True,
        spare_delay_s: float = SPARE_DELAY_S,
    ) -> None:
        """``spare``: keep a child forked ahead of the next request (off: fork on request);
        ``spare_delay_s``: fork it once no request came for that long after the last."""
        # What a cold interpreter would start with: captured before anything changes them.
        self.initial_signals = {s: signal.getsignal(s) for s in signal.valid_signals()}
        self.base_path = base_path
        self.children: dict[int, socket.socket] = {}
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.exists(socket_path):
            os.unlink(socket_path)
        self.listener.bind(socket_path)
        os.chmod(socket_path, 0o600)
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.sel = selectors.DefaultSelector()
        self.spare: Spare | None = None
        self.want_spare = spare
        self.keep_spare = spare
        self.spare_delay_s = spare_delay_s
        self.spare_at = 0.0  # monotonic: not before (the last request + the delay)

    def serve(self, later: Sequence[str] = ()) -> None:
        """Serve until the agent closes our stdin (or dies). Never returns in a child.
        ``later``: modules to import while idle, in order."""
        pending = list(later)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda _s, _f: None)  # the wakeup fd does the work
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(0, selectors.EVENT_READ, "agent")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "child")
        while True:
            wait: float | None = None
            if self.want_spare and not pending:
                wait = self.spare_at - time.monotonic()
                if wait <= 0:
                    wait = None
                    self.want_spare = False  # until a request takes it, or it dies
                    self._fork_spare()
            events = self.sel.select(0 if pending else wait)
            if not events and pending:
                _preload(pending.pop(0))
                if not pending:
                    gc.freeze()  # their pages too stay shared with the children
                    print(f"zygote {os.getpid()}: warmed {','.join(later)}", file=sys.stderr)
                    print(WARMED.decode(), flush=True)
                continue
            for key, _ in events:
                if key.data == "accept":
                    conn, _addr = self.listener.accept()
                    self._request(conn)
                elif key.data == "agent" and not os.read(0, 4096):
                    if self.spare is not None:
                        self.spare.sock.close()  # it exits at EOF: nobody will ask
                    return
                elif key.data == "child":
                    while len(os.read(self.wake_r, 4096)) == 4096:
                        pass
            self._reap()

    def _request(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(REQUEST_TIMEOUT_S)
            with conn.makefile("rb") as f:
                p = Plan.from_json(f.readline())
            conn.settimeout(None)
        except (OSError, ValueError, TypeError) as exc:
            return _refuse(conn, f"bad request: {exc}")
        why = _refusal()
        if why:
            return _refuse(conn, why)
        spare, self.spare = self.spare, None
        self.want_spare = self.keep_spare
        self.spare_at = time.monotonic() + self.spare_delay_s  # not while this rank starts
        if spare is not None and self._hand_over(spare, conn, p):
            return None
        return self._fork(conn, p)

    def _fork_spare(self) -> None:
        """Fork the next rank ahead of its request: the fork (milliseconds for an
        interpreter with torch imported) and the child's detaching then run while idle."""
        if _refusal() is not None:
            return  # a request will be refused and say why
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            print(f"zygote: cannot fork a spare: {exc}", file=sys.stderr, flush=True)
            ours.close()
            theirs.close()
            return
        if pid == 0:  # the spare: never returns into the server loop
            try:
                ours.close()
                self._drop_server(keep=None)
                _wait_as_spare(theirs, self.initial_signals, self.base_path)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        theirs.close()
        if ours.recv(1) == b"r":  # in its own session now
            self.spare = Spare(pid, ours)
        else:
            ours.close()  # it died setting up: _reap collects it; requests fork as before

    def _hand_over(self, spare: Spare, conn: socket.socket, p: Plan) -> bool:
        """Give the request to the spare: its pid to the agent, then the plan and the
        connection to the spare, which runs it. False: the spare is gone, fork instead."""
        if select.select([spare.sock], [], [], 0)[0]:  # it only ever closes its end
            spare.sock.close()
            return False
        if not _send(conn, {"pid": spare.pid}):
            os.kill(spare.pid, signal.SIGKILL)  # the agent is gone: it must never run
            spare.sock.close()
            conn.close()
            return True
        self.children[spare.pid] = conn  # _reap reports its status, whatever happens next
        with contextlib.suppress(OSError):  # it died just now: _reap reports how
            socket.send_fds(spare.sock, [p.to_json()], [conn.fileno()])
        spare.sock.close()
        return True

    def _fork(self, conn: socket.socket, p: Plan) -> None:
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in (ready_r, ready_w, go_r, go_w):
                os.close(fd)
            return _refuse(conn, f"fork failed: {exc}")
        if pid == 0:  # the child: never returns into the server loop
            try:
                os.close(ready_r)
                os.close(go_w)
                self._drop_server(keep=conn)
                _detach(self.initial_signals)
                os.write(ready_w, b"r")
                os.close(ready_w)
                go = os.read(go_r, 1)
                os.close(go_r)
                if go != b"g":
                    os._exit(1)  # the server died before the agent learned this pid: never run
                _become(p, conn, self.base_path)
            except BaseException:
                traceback.print_exc()  # into the rank's log, once it is set up
            finally:
                os._exit(1)
        os.close(ready_w)
        os.close(go_r)
        started = os.read(ready_r, 1) == b"r"  # the child is in its own session now
        os.close(ready_r)
        if started and _send(conn, {"pid": pid}):
            os.write(go_w, b"g")
            self.children[pid] = conn
        else:
            if started:
                os.kill(pid, signal.SIGKILL)  # the agent is gone: it must never run
            conn.close()
        os.close(go_w)

    def _drop_server(self, keep: socket.socket | None) -> None:
        signal.set_wakeup_fd(-1)
        self.sel.close()
        self.listener.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        for c in self.children.values():
            if c is not keep:
                c.close()
        if self.spare is not None:
            self.spare.sock.close()  # else the spare would not see the server's end

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.spare is not None and pid == self.spare.pid:
                self.spare.sock.close()  # killed while it waited: fork the next one
                self.spare = None
                self.want_spare = self.keep_spare
            conn = self.children.pop(pid, None)
            if conn is not None:
                _send(conn, _status(os.waitstatus_to_exitcode(status), "zygote"))
                conn.close()


def _refusal() -> str | None:
    if threading.active_count() != 1:
        return f"{threading.active_count()} threads run in the warm interpreter; fork is unsafe"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the warm interpreter; a forked child cannot use it"
    return None


def _refuse(conn: socket.socket, why: str) -> None:
    _send(conn, {"error": why})
    conn.close()


def _send(conn: socket.socket, msg: dict[str, Any]) -> bool:
    try:
        conn.sendall(json.dumps(msg).encode() + b"\n")
        return True
    except OSError:
        return False


def _status(code: int, by: str) -> dict[str, Any]:
    """A status in ``Popen.returncode`` form (negative: killed by that signal) as a message."""
    return {"signal": -code, "by": by} if code < 0 else {"exit_code": code, "by": by}


# -- the child ----------------------------------------------------------------------------


def _detach(initial_signals: Mapping[signal.Signals, Any]) -> None:
    """What a child does before it knows its plan (a spare does it ahead; ~5 ms of a warm
    start with torch imported): the interpreter's own signal dispositions, an empty mask, a
    session of its own; a fresh view of the file system for imports (no import runs until
    the plan's script); its own seeds; none of the server's finalizers."""
    for sig, handler in initial_signals.items():
        if handler is not None:
            with contextlib.suppress(OSError, ValueError):  # SIGKILL, SIGSTOP
                signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    os.setsid()
    importlib.invalidate_caches()
    random.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if "torch" in sys.modules:  # torch seeds its CPU generator from the OS at start, too
        sys.modules["torch"].default_generator.seed()
    if "multiprocessing.process" in sys.modules:
        sys.modules["multiprocessing.process"].current_process().authkey = os.urandom(32)
    _disown_finalizers()


SPARE_NAME = "trainpod-spare"
"""A waiting spare's process name (``/proc/PID/comm``, at most 15 bytes)."""


def _rename(name: str) -> str:
    """Set this process's name (Linux: the main thread's ``comm``); returns the old one, or
    ``name`` where it cannot be read or set."""
    comm = f"/proc/{os.getpid()}/comm"
    try:
        with open(comm) as f:
            old = f.read().strip()
        with open(comm, "w") as f:
            f.write(name)
        return old
    except OSError:
        return name


def _wait_as_spare(
    sock: socket.socket, initial_signals: Mapping[signal.Signals, Any], base_path: list[str]
) -> None:
    """A spare: detach, say so, wait for a plan and its connection (the server sent our pid
    to the agent before it sends them), then become that rank. EOF: the server is gone or
    closing, and nobody will ever ask: exit quietly."""
    name = _rename(SPARE_NAME)  # first: a spare is never seen without its name for long
    _detach(initial_signals)
    sock.sendall(b"r")
    line, fds = b"", []
    while not line.endswith(b"\n"):
        data, got, _flags, _addr = socket.recv_fds(sock, 1 << 16, 1)
        fds += got
        if not data:
            os._exit(0 if not line else 1)
        line += data
    sock.close()
    if len(fds) != 1:
        os._exit(1)
    _rename(name)
    _become(Plan.from_json(line), socket.socket(fileno=fds[0]), base_path)


def _become(p: Plan, conn: socket.socket, base_path: list[str]) -> None:
    os.register_at_fork(after_in_child=conn.close)  # our status is ours, not our children's
    _stdio(p)
    os.chdir(p.cwd)
    os.environ.clear()
    os.environ.update(p.env)
    sys.orig_argv, sys.executable = list(p.argv), p.executable
    if "multiprocessing.spawn" in sys.modules:  # it copied sys.executable when imported
        sys.modules["multiprocessing.spawn"].set_executable(p.executable)
    head = [os.path.dirname(os.path.realpath(p.script)) if p.script else os.getcwd()]
    extra = [d for d in p.env.get("PYTHONPATH", "").split(os.pathsep) if d]
    sys.path[:] = ([] if _safe_path() else head) + extra + base_path
    code = _run(p)
    _finalize()
    _send(conn, _status(code, "rank"))
    if code == -signal.SIGINT:  # as python does after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code if code >= 0 else 128 - code)


def _stdio(p: Plan) -> None:
    """stdin from /dev/null, stdout and stderr appended to the log, and the text streams
    rebuilt the way the interpreter builds them (so ``-u``/PYTHONUNBUFFERED apply)."""
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(p.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    unbuffered = p.unbuffered or bool(p.env.get("PYTHONUNBUFFERED"))

    def stream(fd: int, like: TextIO) -> io.TextIOWrapper:
        mode = "rb" if fd == 0 else "wb"
        buf = open(fd, mode, buffering=0 if unbuffered and fd else -1, closefd=False)  # noqa: SIM115
        return io.TextIOWrapper(
            buf,  # unbuffered: the raw FileIO, as the interpreter does with -u
            encoding=like.encoding,
            errors=like.errors,
            newline="\n" if fd else None,
            line_buffering=fd == 2 and not unbuffered,
            write_through=unbuffered and fd != 0,
        )

    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        s = stream(fd, getattr(sys, name))
        setattr(sys, name, s)
        setattr(sys, f"__{name}__", s)  # the originals, as at interpreter start


def _run(p: Plan) -> int:
    """Run the script in a fresh ``__main__``; its status in ``Popen.returncode`` form."""
    zygote_main = sys.modules["__main__"]  # noqa: F841  # our globals stay alive throughout
    main = types.ModuleType("__main__")  # as the interpreter's add_main_module makes it
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    main.__annotations__ = {}
    sys.modules["__main__"] = main
    try:
        if p.module is not None:
            sys.argv = ["-m", *p.args]
            # What `python -m` itself calls; it runs the module in sys.modules["__main__"].
            run_as_main: Callable[[str, bool], Any] = getattr(runpy, "_run_module_as_main")  # noqa: B009
            run_as_main(p.module, True)
        else:
            assert p.script is not None
            sys.argv = [p.script, *p.args]
            path = os.path.abspath(p.script)
            main.__file__ = path
            main.__cached__ = None  # type: ignore[attr-defined]
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
            with io.open_code(path) as f:
                code = compile(f.read(), path, "exec", dont_inherit=True)
            exec(code, main.__dict__)
    except SystemExit as exc:
        return _exit_code(exc)
    except KeyboardInterrupt:
        _print_uncaught()
        return -signal.SIGINT
    except BaseException:
        _print_uncaught()
        return 1
    return 0


def _preload(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception as exc:  # a rank that needs it will fail the same way, cold
        print(f"zygote: cannot preload {name}: {exc!r}", file=sys.stderr, flush=True)


def _safe_path() -> bool:
    return bool(getattr(sys.flags, "safe_path", False))  # -P / PYTHONSAFEPATH, Python 3.11+


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _print_uncaught() -> None:
    etype, value, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # our frames: python's own traceback starts at the script
    try:
        assert etype is not None and value is not None
        sys.excepthook(etype, value.with_traceback(tb), tb)
    except BaseException:
        traceback.print_exc()


def _disown_finalizers() -> None:
    """Keep the server's ``weakref.finalize`` objects from running at the rank's exit."""
    registry: dict[weakref.finalize[Any, Any], Any] = getattr(weakref.finalize, "_registry", {})
    for fin in list(registry):
        fin.atexit = False


def _finalize() -> None:
    """What the interpreter does before exiting: join non-daemon threads, run atexit."""
    try:
        getattr(threading, "_shutdown")()  # noqa: B009  # private, as Process._bootstrap uses it
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            s.flush()


# -- entry point --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainpod.agent.zygote")
    parser.add_argument("--socket", required=True, help="the Unix socket to serve on")
    parser.add_argument("--preload", default="", help="comma-separated modules to import")
    parser.add_argument(
        "--later", default="", help="comma-separated modules to import once ready, while idle"
    )
    parser.add_argument(
        "--no-spare", action="store_true", help="fork on each request, none ahead (to compare)"
    )
    parser.add_argument(
        "--spare-delay-s",
        type=float,
        default=SPARE_DELAY_S,
        help="fork the next spare once no request came for this long",
    )
    args = parser.parse_args(argv)
    # sys.path as a rank's interpreter would build it, less its first entry (the script's
    # dir, or the cwd for -m) and our own PYTHONPATH (the rank's is applied in the child).
    ours = [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d]
    base = list(sys.path if _safe_path() else sys.path[1:])
    for d in ours:
        if d in base:
            base.remove(d)
    zygote = Zygote(args.socket, base, spare=not args.no_spare, spare_delay_s=args.spare_delay_s)
    for name in filter(None, args.preload.split(",")):
        _preload(name)
    gc.freeze()  # keep the preloaded objects' pages shared with the children
    print(f"zygote {os.getpid()}: preloaded {args.preload or 'nothing'}", file=sys.stderr)
    later = [m for m in args.later.split(",") if m]
    if later:
        print(WARMING.decode(), flush=True)  # first: the agent knows before it sends anything
    print(READY.decode(), flush=True)
    zygote.serve(later=later)
    with contextlib.suppress(OSError):
        os.unlink(args.socket)


if __name__ == "__main__":
    main()
