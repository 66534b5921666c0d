"""The sandbox contains what model-written code may do."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from qmc_sampler.eval.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(cpu_seconds=2, wall_seconds=5)


def test_a_normal_program_runs_and_its_output_comes_back():
    result = run_python("print(6 * 7)", FAST)
    assert result.status == "ok" and result.stdout.strip() == "42"


def test_an_infinite_loop_is_stopped_by_the_cpu_limit():
    # A wall limit far above the CPU limit: on a loaded machine (two pytest workers beside other
    # work) the loop gets a fraction of a core, and 2 CPU-seconds took over 5 wall-seconds.
    limits = SandboxLimits(cpu_seconds=2, wall_seconds=60)
    start = time.monotonic()
    result = run_python("while True:\n    pass", limits)
    assert result.status == "error" and time.monotonic() - start < limits.wall_seconds


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
    marker = f"/dev/shm/qmc-daemon-{os.getpid()}"
    program = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(3)\n"
        f"    open('/proc/1/cwd/../{os.path.basename(marker)}', 'w')\n"
        "print('parent exits')\n"
    )
    assert run_python(program, FAST).status == "ok"
    time.sleep(4)
    assert not os.path.exists(marker)


def test_a_fork_bomb_hits_the_process_limit():
    result = run_python("import os\nfor _ in range(10000):\n    os.fork()", FAST)
    assert result.status == "error"


def test_a_fork_bomb_does_not_starve_a_sandbox_running_beside_it():
    # The process limit counts a user's processes: each run has a user id of its own, so
    # another sample verified meanwhile (another worker, another qmc-eval) still starts.
    bomb = "import os, time\nfor _ in range(200):\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    bomb += "time.sleep(3)"
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_python, bomb, FAST)
        time.sleep(1.0)  # the bomb holds its process limit now
        program = "import subprocess, sys\n"
        program += "print(subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True).stdout.decode())"
        beside = run_python(program, FAST)
        running.result()
    assert beside.status == "ok" and beside.stdout.strip() == "7", beside


@pytest.mark.parametrize("code", ["import sys; sys.exit(3)", "raise SystemExit('boom')", "1/0"])
def test_failures_are_reported_as_errors(code):
    assert run_python(code, FAST).status == "error"
