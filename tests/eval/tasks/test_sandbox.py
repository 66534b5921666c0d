"""The sandbox contains what model-written code may do.

No test here compares durations: each limit is shown by how the program ended (the signal of
the CPU limit, the wall limit's ``timeout``, a ``MemoryError``) or by what the host sees (a
daemon's process, a fork bomb's processes), so the tests hold on a machine of any speed or load.
The wall limits are backstops, far above what the programs need.
"""

import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from qmc_sampler.eval.tasks.sandbox import SandboxLimits, run_python

#: Limits for programs that end by themselves or by a limit other than the wall clock's.
FAST = SandboxLimits(cpu_seconds=2, wall_seconds=120)


def processes(where) -> list[int]:
    """Host pids of the processes whose ``/proc/PID/status`` and ``cmdline`` satisfy ``where(status, cmdline)``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):  # not a process, or gone meanwhile
            continue
        if entry.name.isdigit() and where(status, cmdline):
            found.append(int(entry.name))
    return found


def real_uid(status: str) -> int:
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def test_a_normal_program_runs_and_its_output_comes_back():
    result = run_python("print(6 * 7)", FAST)
    assert result.status == "ok" and result.stdout.strip() == "42"


def test_an_infinite_loop_is_stopped_by_the_cpu_limit():
    # The CPU limit's own signals (SIGXCPU at the soft limit, SIGKILL at the hard one) say which limit
    # stopped it, however long 2 CPU-seconds take on this machine; the wall limit would say "timeout".
    result = run_python("while True:\n    pass", FAST)
    assert result.status == "error", result
    assert result.returncode in (128 + signal.SIGXCPU, 128 + signal.SIGKILL), result


def test_a_sleeping_program_is_killed_at_the_wall_clock_limit():
    result = run_python("import time\ntime.sleep(60)", SandboxLimits(wall_seconds=2))
    assert result.status == "timeout"


def test_a_memory_bomb_fails_inside_the_limit():
    result = run_python("x = bytearray(8 * 1024**3)", FAST)
    assert result.status == "error" and "MemoryError" in result.stderr


def test_there_is_no_network():
    program = "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=2)"
    result = run_python(program, FAST)
    assert result.status == "error" and ("unreachable" in result.stderr or "refused" in result.stderr)
    assert (
        "Network is unreachable"
        in run_python("import socket\nsocket.create_connection(('1.1.1.1', 80), 2)", FAST).stderr
    )


def test_files_outside_the_temp_dir_cannot_be_written(tmp_path):
    target = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)  # even a world-writable folder outside /tmp stays out of reach
    for path in (str(target), "/root/escaped.txt", "/etc/escaped.txt"):
        result = run_python(f"open({path!r}, 'w').write('x')", FAST)
        assert result.status == "error", path
    assert not target.exists()


def test_temp_files_are_private_and_vanish():
    marker = f"/tmp/qmc-sandbox-{os.getpid()}.txt"
    result = run_python(f"open({marker!r}, 'w').write('x')\nprint(open({marker!r}).read())", FAST)
    assert result.status == "ok" and result.stdout.strip() == "x"
    assert not os.path.exists(marker)


def test_processes_it_starts_do_not_outlive_it():
    # A daemon (its own session) that would sleep for an hour under a name the host can find; the
    # program exits once the daemon has exec'd (a close-on-exec pipe reads EOF), so a daemon that
    # survived would be in the host's process table when run_python returns.
    token = f"qmc-daemon-{uuid.uuid4().hex}"
    program = (
        "import os, sys\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.close(r)\n"
        "    os.setsid()\n"
        "    null = os.open(os.devnull, os.O_RDWR)\n"
        "    for fd in (0, 1, 2):\n"
        "        os.dup2(null, fd)  # a survivor holds no pipe of run_python open\n"
        f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(3600)', {token!r}])\n"
        "os.close(w)\n"
        "assert os.read(r, 1) == b''\n"
        "print('parent exits')\n"
    )
    assert run_python(program, FAST).status == "ok"
    survivors = processes(lambda status, cmdline: token in cmdline)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors


def test_a_fork_bomb_hits_the_process_limit():
    result = run_python("import os\nfor _ in range(10000):\n    os.fork()", FAST)
    assert result.status == "error"


def test_a_fork_bomb_does_not_starve_a_sandbox_running_beside_it():
    # The process limit counts a user's processes: each run has a user id of its own, so
    # another sample verified meanwhile (another worker, another qmc-eval) still starts.
    if os.geteuid() != 0:
        pytest.skip("per-run user ids need root (unprivileged, the sandbox keeps the caller's user id)")
    bomb = "import os, time\nfor _ in range(200):\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    bomb += "time.sleep(3600)"  # held until this test ends it, below
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_python, bomb, SandboxLimits(cpu_seconds=2, wall_seconds=600))

        def sandboxed(status: str, cmdline: str) -> bool:
            """A sandboxed program (``python3 -I -B -``) or its launcher (eval/tasks/sandbox_exec.py)."""
            return cmdline.split("\0")[1:4] == ["-I", "-B", "-"] or "sandbox_exec.py" in cmdline

        def bomb_user() -> tuple[int, list[int]]:
            """The bomb's user id (the sandboxed one with the most processes; other tests' sandboxes have
            theirs), how many processes that user has in all, and which of them are the sandbox's."""
            by_uid: dict[int, list[int]] = {}
            for pid in processes(sandboxed):
                try:
                    by_uid.setdefault(real_uid(Path(f"/proc/{pid}/status").read_text()), []).append(pid)
                except OSError:  # gone meanwhile
                    continue
            if not by_uid:
                return 0, []
            uid = max(by_uid, key=lambda u: len(by_uid[u]))
            return len(processes(lambda status, cmdline: real_uid(status) == uid)), by_uid[uid]

        try:
            # Until the bomb holds its whole process limit (a condition, not a pause of some length).
            while bomb_user()[0] < FAST.processes:
                assert not running.done(), running.result()
                time.sleep(0.1)
            program = "import subprocess, sys\n"
            program += "print(subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True).stdout.decode())"
            beside = run_python(program, FAST)
        finally:
            for pid in bomb_user()[1]:  # ends the bomb's run (its launcher and PID 1 among them)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            running.result()
    assert beside.status == "ok" and beside.stdout.strip() == "7", beside


@pytest.mark.parametrize("code", ["import sys; sys.exit(3)", "raise SystemExit('boom')", "1/0"])
def test_failures_are_reported_as_errors(code):
    assert run_python(code, FAST).status == "error"
