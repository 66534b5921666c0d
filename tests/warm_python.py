"""A Python that has imported the heavy libraries once, forking a fresh child per run.

Tests that need a *fresh* interpreter (a mutated copy of the package, a docs block, a script
with its own environment) spent most of their time importing torch, transformers and vLLM
again. :class:`WarmPython` imports them once in a server process and forks it for each run:
the child starts with those libraries loaded and nothing of ``qmc_sampler`` (the server
checks that it never imported it), sets its environment, working directory, ``sys.path`` and
``sys.argv``, and runs the module or script as ``python -m``/``python FILE`` would. Its exit
code, a signal included, and its output come back as from :func:`subprocess.run`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

#: Imported once by the server: what every run would import again (no qmc_sampler among them).
PRELOAD = ("numpy", "scipy.stats", "torch", "transformers", "pytest", "hypothesis", "vllm", "vllm.config")

_SERVER = r"""
import importlib, json, os, runpy, sys, traceback
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # (an optional library: the runs that need it import it themselves)
assert not any(m == "qmc_sampler" or m.startswith("qmc_sampler.") for m in sys.modules), "preloaded qmc_sampler"
base_path = list(sys.path)
print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(request["errors"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    pid = os.fork()
    if pid == 0:  # the child: becomes the run
        code = 1
        try:
            os.dup2(out, 1)
            os.dup2(err, 2)
            os.close(out)
            os.close(err)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.setpgid(0, 0)  # its own group: a timed-out run is killed with whatever it started
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            sys.path[:] = [*request["path_first"], *base_path]
            argv = request["argv"]
            sys.argv = argv[1:] if argv[0] == "-m" else argv
            if argv[0] == "-m":
                sys.argv[0] = argv[1]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            elif argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            else:
                sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    os.close(out)
    os.close(err)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": status}), flush=True)
"""


class WarmPython:
    """A server process that forks a fresh child per :meth:`run` (one run at a time).

    Args:
        env: the server's environment (the children get the one each run names).
        preload: modules the server imports before it forks.
    """

    def __init__(self, env: dict[str, str] | None = None, preload: tuple[str, ...] = PRELOAD) -> None:
        self._server = subprocess.Popen(
            [sys.executable, "-P", "-c", _SERVER, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(env or os.environ),
            text=True,
        )
        self._lines = b""
        ready = self._read(timeout=300)
        if "ready" not in ready:
            raise RuntimeError(f"the warm Python did not start: {ready}")
        self._scratch = tempfile.TemporaryDirectory(prefix="warm-python-")

    def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str | Path,
        path_first: tuple[str, ...] = (),
        timeout: float = 600,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` in a fresh fork of the server, as ``python -P ARGV`` would run it.

        Args:
            argv: as after ``python`` on a command line: ``["-m", module, *args]``,
                ``["-c", source, *args]`` or ``[script, *args]``.
            env: the run's whole environment.
            cwd: its working directory.
            path_first: entries put before ``sys.path`` (as ``PYTHONPATH`` would; the server
                runs with ``-P``, so the working directory is not on it).
            timeout: seconds before the run (with its process group) is killed.

        Returns:
            ``CompletedProcess`` with ``returncode`` (``-N`` for signal N), ``stdout`` and ``stderr``.

        Raises:
            subprocess.TimeoutExpired: the run took longer than ``timeout``.
        """
        output, errors = Path(self._scratch.name) / "run.out", Path(self._scratch.name) / "run.err"
        request = {"argv": list(argv), "env": dict(env), "cwd": str(cwd), "path_first": list(path_first),
                   "output": str(output), "errors": str(errors)}  # fmt: skip
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        pid = self._read(timeout=60)["pid"]
        try:
            status = self._read(timeout=timeout)["status"]
        except subprocess.TimeoutExpired:
            os.killpg(pid, signal.SIGKILL)
            self._read(timeout=60)
            raise
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return subprocess.CompletedProcess(
            argv, code, output.read_text(errors="replace"), errors.read_text(errors="replace")
        )

    def close(self) -> None:
        """Stop the server."""
        self._server.stdin.close()
        try:
            self._server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._server.kill()
        self._scratch.cleanup()

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
                raise RuntimeError(f"the warm Python exited ({self._server.wait()})")
            self._lines += chunk
        line, self._lines = self._lines.split(b"\n", 1)
        return json.loads(line)
