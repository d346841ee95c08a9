"""The agent's side of warm starts: keep a zygote running and start ranks through it.

:class:`WarmStarter` runs ``python -m trainpod.agent.zygote`` (see there) in the background,
restarts it when it dies, and turns a rank into a :class:`WarmProcess` when :func:`plan` says
the command can start warm and the zygote is ready; otherwise it says why not, and the
launcher starts the rank cold. A :class:`WarmProcess` looks like a ``subprocess.Popen`` to
the launcher: ``pid`` and ``wait(timeout)``, with ``Popen.returncode`` semantics.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from trainpod.agent.zygote import READY, WARMED, WARMING, Plan
from trainpod.spec.workerenv import DEFAULT_ENV_ALLOW, allowed

log = logging.getLogger(__name__)

# trainpod itself too (its beacon, notice and checkpoint modules read the environment on
# their first call, never at import, so the server's values do not leak into a rank): a rank
# that reports progress or watches for the preemption notice no longer imports it per start.
DEFAULT_PRELOAD = ("torch", "torch.distributed", "trainpod")
# Imported once the zygote is ready, while it has no request to serve (so they never delay a
# rank): every torch optimizer's constructor imports dynamo (and with it sympy), trainpod's
# Checkpointer imports DCP; seconds of every training rank's start otherwise, restarts and
# in-process replacements included. A rank forked before they are in pays as it would cold.
AGENT_WARM_LATER = ("torch._dynamo", "torch.distributed.checkpoint")
WARMING_REPLY_TIMEOUT_S = 120.0
"""How long a rank's start waits for the zygote while it imports its later modules (a cold
start would import them too, after torch): a loaded 2-core box took 10 s for dynamo."""
# Read by the interpreter or by the preloaded libraries when they load: a rank that needs
# other values than the zygote's must start cold. PYTHONPATH and PYTHONUNBUFFERED are applied
# in the child; PYTHONBREAKPOINT is read at each breakpoint(), PYTHONSTARTUP only by a shell.
LOAD_TIME_PREFIXES: tuple[str, ...] = (
    *("PYTHON", "LD_", "MALLOC_", "LC_", "LANG", "TZ"),
    *("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH_", "PYTORCH_"),
)
APPLIED_IN_CHILD = {"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONBREAKPOINT", "PYTHONSTARTUP"}


def zygote_env(environ: Mapping[str, str], inherited: Mapping[str, str]) -> dict[str, str]:
    """The zygote's own environment: the agent's ``environ`` (the zygote is trainpod's; it
    needs, say, the agent's PYTHONPATH to import trainpod) less the load-time variables its
    ranks do not inherit (``inherited``: the spec's ``env_allow``), so that a rank whose
    environment is built from the allow-list can start warm."""
    return {
        k: v
        for k, v in environ.items()
        if not k.startswith(LOAD_TIME_PREFIXES) or k in APPLIED_IN_CHILD or k in inherited
    }


def agents_zygote_env() -> dict[str, str]:
    """:func:`zygote_env` of this process's environment and the default ``env_allow``: what
    an agent started here with a spec that sets none gives its zygote (before node_env)."""
    return zygote_env(os.environ, allowed(os.environ, DEFAULT_ENV_ALLOW))


def plan(
    argv: list[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    log: str,
    zygote_env: Mapping[str, str],
    executable: str = sys.executable,
) -> Plan | str:
    """The plan to start ``argv`` warm, or why it must start cold. Pure but for stat calls.

    Warm: ``argv[0]`` is this interpreter (a bare name is looked up on ``env["PATH"]``), then
    ``-u`` at most, then a script file or ``-m module``; every load-time variable has the
    same value in ``env`` as in ``zygote_env``; and ``TRAINPOD_WARM_START`` is not ``0``."""
    if env.get("TRAINPOD_WARM_START", "1") == "0":
        return "TRAINPOD_WARM_START=0"
    if not argv:
        return "empty command"
    if not os.path.isdir(cwd):
        return f"no working directory {cwd}"
    exe = _resolve(argv[0], cwd, env.get("PATH", os.defpath))
    if exe is None or not _same_python(exe, executable):
        return f"{argv[0]!r} is not the agent's interpreter {executable}"
    rest, unbuffered = argv[1:], False
    while rest and rest[0] == "-u":
        rest, unbuffered = rest[1:], True
    script = module = None
    if len(rest) >= 2 and rest[0] == "-m":
        module, args = rest[1], rest[2:]
    elif rest and not rest[0].startswith("-"):
        script, args = rest[0], rest[1:]
        if not os.path.isfile(os.path.join(cwd, script)) or script.endswith((".pyc", ".zip")):
            return f"{script!r} is not a Python source file in {cwd}"
    else:
        return "only `python [-u] SCRIPT ...` and `python [-u] -m MODULE ...` start warm"
    differ = sorted(
        k
        for k in {*env, *zygote_env}
        if k.startswith(LOAD_TIME_PREFIXES)
        and k not in APPLIED_IN_CHILD
        and env.get(k) != zygote_env.get(k)
    )
    if differ:
        return f"load-time variables differ from the warm interpreter's: {', '.join(differ)}"
    exe = os.path.abspath(os.path.join(cwd, exe))
    return Plan(list(argv), exe, cwd, dict(env), log, script, module, list(args), unbuffered)


def _resolve(name: str, cwd: str, path: str) -> str | None:
    if os.sep in name:
        return os.path.join(cwd, name)
    return shutil.which(name, path=path)


def _same_python(candidate: str, executable: str) -> bool:
    # The same binary *and* the same bin dir: a venv's python is a symlink to the base
    # interpreter, yet another environment (its pyvenv.cfg is found next to the link).
    real = os.path.realpath
    same_dir = real(os.path.dirname(candidate)) == real(os.path.dirname(executable))
    return same_dir and real(candidate) == real(executable)


class WarmProcess:
    """A rank forked by the zygote, as the launcher sees a ``Popen``. Thread-safe."""

    def __init__(self, pid: int, sock: socket.socket, reader: IO[bytes], args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._sock = sock
        self._reader = reader
        self._lock = threading.Lock()
        self._reading = False
        self._done = threading.Event()
        self._last_signal: int | None = None

    def note_signal(self, sig: int) -> None:
        """The launcher sent ``sig``: the best guess at a death the zygote cannot report."""
        if sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGINT):
            self._last_signal = sig

    def wait(self, timeout: float | None = None) -> int:
        """The return code once the rank has ended (negative: the signal that killed it).

        Raises ``subprocess.TimeoutExpired`` like ``Popen.wait``. The first call without a
        timeout reads the zygote's report in the calling thread."""
        if timeout is None:
            with self._lock:
                reader, self._reading = not self._reading, True
            if reader:
                self._read()
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _read(self) -> None:
        own: int | None = None  # the status the rank reported itself, before it exited
        code: int | None = None
        try:
            for line in self._reader:
                msg: dict[str, Any] = json.loads(line)
                status = -int(msg["signal"]) if "signal" in msg else int(msg["exit_code"])
                if msg.get("by") == "zygote":
                    code = status
                    break
                own = status
        except (OSError, ValueError, KeyError):
            pass
        finally:
            self._reader.close()
            self._sock.close()
        if code is None:
            # The zygote died: the rank (no longer its child) has closed its end by now.
            _wait_gone(self.pid)
            fallback = -(self._last_signal or signal.SIGKILL)
            code = own if own is not None else fallback
            log.warning("rank pid %d outlived the warm-start server; status %s", self.pid, code)
        self.returncode = code
        self._done.set()


def _wait_gone(pid: int) -> None:
    """Block until ``pid`` has exited (it may have exec'd, closing our socket early)."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone already (or no pidfd here): nothing to wait for
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


class WarmStarter:
    """Keeps one zygote process running for this agent and starts ranks through it.

    ``start()`` returns at once; until the zygote is ready (or while it is being restarted
    after dying) :meth:`spawn` answers why not, and the rank starts cold."""

    def __init__(
        self,
        *,
        socket_path: Path,
        log_path: Path,
        env: Mapping[str, str],
        preload: Sequence[str] = DEFAULT_PRELOAD,
        later: Sequence[str] = (),
        executable: str = sys.executable,
        reply_timeout_s: float = 10.0,
        restart_delay_s: float = 1.0,
        cwd: Path | None = None,
        spare: bool = True,
        spare_delay_s: float | None = None,
    ) -> None:
        """``restart_delay_s``: the wait before restarting a zygote that died young (doubling
        up to a minute while it keeps dying; none after one that lived for a minute).
        ``cwd``: where the zygote runs, and so where its ``preload`` modules are looked for
        first (None: the socket's dir). ``later``: modules it imports after it is ready,
        while idle (the agent's: :data:`AGENT_WARM_LATER`). ``spare``: the zygote keeps a
        child forked ahead of the next rank (False: it forks on each request; benchmarks
        compare the two); ``spare_delay_s``: how long after a request it forks the next one
        (None: the zygote's :data:`~trainpod.agent.zygote.SPARE_DELAY_S`)."""
        if len(str(socket_path)) > 100:
            raise ValueError(f"socket path {socket_path} is too long for a Unix socket")
        self.socket_path = socket_path
        self._log_path = log_path
        # The controller gives every job OMP_NUM_THREADS=1 unless the job says otherwise
        # (controller/launch.py); the zygote must load its libraries with the same value.
        self.env = {"OMP_NUM_THREADS": "1", **env}
        self._preload = list(preload)
        self._later = list(later)
        self._spare = spare
        self._spare_delay_s = spare_delay_s
        self._cwd = cwd if cwd is not None else socket_path.parent
        self._executable = executable
        self._timeout = reply_timeout_s
        self._restart_delay = restart_delay_s
        self._ready = threading.Event()
        self._warming = threading.Event()  # importing its later modules: replies may wait
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None

    @property
    def later(self) -> list[str]:
        """The modules it imports once ready, while idle."""
        return list(self._later)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def pid(self) -> int | None:
        """The zygote's pid while one runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start the zygote (and restart it whenever it dies) in a thread. Returns at once."""
        self._thread = threading.Thread(target=self._supervise, name="zygote", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the zygote (ranks it started keep running). Idempotent; returns at once when
        the zygote is still importing (it is killed: the agent must not wait for torch)."""
        with self._lock:
            self._closing.set()
            proc = self._proc
        if proc is not None and proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()  # its lifeline: once ready, it exits at EOF
            if not self._ready.is_set():
                proc.kill()  # still preloading, so it has forked nothing
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def spawn(
        self, argv: list[str], *, cwd: str, env: Mapping[str, str], log_path: Path
    ) -> WarmProcess | str:
        """Start a rank through the zygote, or say why it must start cold. Never raises."""
        p = plan(argv, cwd=cwd, env=env, log=str(log_path), zygote_env=self.env)
        if isinstance(p, str):
            return p
        if not self._ready.is_set():
            return "the warm-start server is not ready"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        warming = self._warming.is_set()
        sock.settimeout(max(self._timeout, WARMING_REPLY_TIMEOUT_S) if warming else self._timeout)
        try:
            sock.connect(str(self.socket_path))
            sock.sendall(p.to_json())
            reader = sock.makefile("rb")
            reply = json.loads(reader.readline() or b"{}")
        except (OSError, ValueError) as exc:
            sock.close()
            if isinstance(exc, TimeoutError):
                # It may hold a forked child waiting for its go: killing it cancels that.
                self._kill_zygote()
            return f"the warm-start server did not answer: {exc!r}"
        if "pid" not in reply:
            reader.close()
            sock.close()
            return f"the warm-start server refused: {reply.get('error', 'it closed')}"
        sock.settimeout(None)
        return WarmProcess(int(reply["pid"]), sock, reader, list(argv))

    def _kill_zygote(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def _supervise(self) -> None:
        delay = 0.0
        while not self._closing.wait(delay):
            started = time.monotonic()
            try:
                proc = self._launch()
            except OSError as exc:
                log.warning("cannot start the warm-start server: %s", exc)
                delay = 60.0
                continue
            if proc is None:
                return
            assert proc.stdout is not None
            for line in proc.stdout:  # "ready" once preloaded; EOF when it exits
                if line.strip() == READY:
                    self._ready.set()
                    took = time.monotonic() - started
                    log.info("warm-start server (pid %d) ready in %.1fs", proc.pid, took)
                elif line.strip() == WARMING:
                    self._warming.set()
                elif line.strip() == WARMED:
                    self._warming.clear()
                    took = time.monotonic() - started
                    log.info("warm-start server (pid %d) warmed in %.1fs", proc.pid, took)
                else:
                    log.info("warm-start server: %s", line.decode(errors="replace").rstrip())
            code = proc.wait()
            self._ready.clear()
            self._warming.clear()
            if self._closing.is_set():
                return
            lived = time.monotonic() - started
            delay = 0.0 if lived > 60 else min(max(self._restart_delay, 2 * delay), 60.0)
            log.warning(
                "warm-start server (pid %d) exited with %d; ranks start cold until it is "
                "back (restarting in %.0fs; its log: %s)",
                proc.pid,
                code,
                delay,
                self._log_path,
            )

    def _launch(self) -> subprocess.Popen[bytes] | None:
        """A new zygote, or None when closing."""
        argv = [self._executable, "-m", "trainpod.agent.zygote", "--socket", str(self.socket_path)]
        argv += ["--preload", ",".join(self._preload)]
        if self._later:
            argv += ["--later", ",".join(self._later)]
        if not self._spare:
            argv.append("--no-spare")
        if self._spare_delay_s is not None:
            argv += ["--spare-delay-s", str(self._spare_delay_s)]
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self._closing.is_set():
                return None
            with self._log_path.open("ab") as out:
                self._proc = subprocess.Popen(
                    argv,
                    cwd=self._cwd,
                    env=self.env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=out,
                    start_new_session=True,  # the agent's terminal signals are not its own
                )
        return self._proc
