"""Run untrusted Python (model-written code) in a sandbox: a separate process with no
network, no write access outside a private temp dir, CPU-time, memory, file-size
and process limits, killed with its whole process group on a wall-clock timeout.

The isolation itself is done by :mod:`qmc_sampler.eval.tasks.sandbox_exec` (see its
docstring). The program runs under the system interpreter (``/usr/bin/python3``
by default, ``$QMC_SANDBOX_PYTHON`` to override) because the unprivileged user it
runs as cannot read a virtual environment under ``/root``; HumanEval programs
need only the standard library.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python"]

_LAUNCHER = Path(__file__).with_name("sandbox_exec.py")
_UNCONFINED = 97


class SandboxUnavailable(RuntimeError):
    """The machine cannot confine a process (no namespaces); nothing was run."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run."""

    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_mb: int = 512
    file_mb: int = 8
    tmp_mb: int = 32
    processes: int = 32


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed program ended.

    Attributes:
        status: ``"ok"`` (exit 0), ``"error"`` (non-zero exit or killed by a
            limit), or ``"timeout"`` (wall clock; the process group was killed).
        returncode: the exit code (128 + n: the program died of signal n;
            negative: the launcher was killed on timeout).
        stdout, stderr: the last 4 KiB of each.
    """

    status: str
    returncode: int
    stdout: str
    stderr: str


def _interpreter() -> str:
    return os.environ.get("QMC_SANDBOX_PYTHON") or (
        "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    )


def run_python(program: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``program`` (Python source) in the sandbox and report how it ended.

    Raises:
        SandboxUnavailable: the sandbox cannot be set up on this machine.
    """
    limits = limits or SandboxLimits()
    config = json.dumps(asdict(limits) | {"python": _interpreter()})
    process = subprocess.Popen(
        [sys.executable, "-I", str(_LAUNCHER), config],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(program.encode(), timeout=limits.wall_seconds)
        status = "ok" if process.returncode == 0 else "error"
        _kill_group(process.pid)  # stragglers of the launcher's group, if any
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        out, err = process.communicate()
        status = "timeout"
    if process.returncode == _UNCONFINED and b"sandbox unavailable" in err:
        raise SandboxUnavailable(err.decode(errors="replace").strip())
    return SandboxResult(
        status, process.returncode, out[-4096:].decode(errors="replace"), err[-4096:].decode(errors="replace")
    )


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
