"""A readable console for long jobs: the engine's output goes to a log file, ours to the terminal.

vLLM, its engine-core and worker processes write start-up lines and warnings to
the process's standard output and error, which would bury a progress bar. While
:func:`engine_output_to` is active, file descriptors 1 and 2 — inherited by every
process vLLM spawns — point at a log file, and the caller writes to the real
terminal through the :class:`Console` it yields. If the job fails, the log's
last lines are shown, so nothing is hidden when it matters.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

__all__ = ["Console", "engine_output_to"]

_TAIL_LINES = 30


@dataclass(frozen=True)
class Console:
    """Streams to the terminal: ``out`` for results, ``err`` for progress and errors."""

    out: TextIO
    err: TextIO

    def print(self, *parts: object) -> None:
        print(*parts, file=self.out, flush=True)


@contextlib.contextmanager
def engine_output_to(log_path: Path) -> Iterator[Console]:
    """Redirect this process's (and its children's) stdout and stderr to ``log_path``.

    Yields:
        A :class:`Console` on the original terminal streams.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    console = Console(os.fdopen(os.dup(saved_out), "w", buffering=1), os.fdopen(os.dup(saved_err), "w", buffering=1))
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    try:
        yield console
    except BaseException:
        _show_tail(log_path, console)
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        console.out.close()
        console.err.close()


def _show_tail(log_path: Path, console: Console) -> None:
    try:
        lines = log_path.read_text(errors="replace").splitlines()[-_TAIL_LINES:]
    except OSError:
        return
    if lines:
        console.err.write(f"--- last {len(lines)} lines of {log_path} ---\n" + "\n".join(lines) + "\n")
        console.err.flush()
