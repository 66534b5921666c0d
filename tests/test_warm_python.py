"""tests/warm_python.py: a fork per run behaves as a fresh ``python -P`` would."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def light(warm_python_lib):
    """A warm Python that preloads only the standard library (the protocol, not the imports)."""
    server = warm_python_lib.WarmPython(env=os.environ | {"SERVER_ONLY": "1"}, preload=("json", "decimal"))
    try:
        yield server
    finally:
        server.close()


def test_a_run_gets_its_argv_environment_directory_and_path_and_its_exit_code(light, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv, 'env': dict(os.environ), 'cwd': os.getcwd(),\n"
        "                  'first': sys.path[:2], 'decimal_loaded': 'decimal' in sys.modules,\n"
        "                  'stdin': sys.stdin.read()}))\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    (tmp_path / "extra").mkdir()
    done = light.run([str(script), "a", "b"], env={"PROBE": "yes"}, cwd=tmp_path / "extra", path_first=("/nowhere",))
    seen = json.loads(done.stdout)
    assert done.returncode == 3 and done.stderr == "to stderr\n"
    assert seen["argv"] == [str(script), "a", "b"] and seen["env"] == {"PROBE": "yes"}  # the server's is gone
    assert seen["cwd"] == str(tmp_path / "extra") and seen["first"] == [str(tmp_path), "/nowhere"]
    assert seen["decimal_loaded"] and seen["stdin"] == ""  # preloaded once, before the fork; stdin empty


def test_modules_and_sources_run_in_a_main_module_of_their_own(light, tmp_path):
    by_module = light.run(["-m", "platform", "--terse"], env={}, cwd=tmp_path)
    assert by_module.returncode == 0 and by_module.stdout.strip(), by_module.stderr
    source = (
        "import pickle, sys\n"
        "def f(): pass\n"
        "assert pickle.loads(pickle.dumps(f)) is f and sys.modules['__main__'].f is f\n"
        "print(sys.argv); raise SystemExit('bad')\n"
    )
    by_source = light.run(["-c", source, "x"], env={}, cwd=tmp_path)
    assert by_source.stdout == "['-c', 'x']\n" and by_source.returncode == 1 and by_source.stderr == "bad\n"


def test_a_run_ends_as_python_ends_atexit_and_threads_included(light, tmp_path):
    source = (
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), print('thread done', flush=True))).start()\n"
    )
    done = light.run(["-c", source], env={}, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == "thread done\natexit ran\n", done


def test_the_preloads_are_out_of_the_collectors_reach_and_what_a_run_makes_is_collected(light, tmp_path):
    source = (
        "import decimal, gc, json, weakref\n"
        "class Cycle: pass\n"
        "a, b = Cycle(), Cycle()\n"
        "a.other, b.other = b, a\n"
        "gone = weakref.ref(a)\n"
        "del a, b\n"
        "gc.collect()\n"
        "print(json.dumps({'frozen': gc.get_freeze_count(), 'collected': gone() is None,\n"
        "                  'decimal_frozen': any(o is decimal for o in gc.get_objects()) is False}))\n"
    )
    done = light.run(["-c", source], env={}, cwd=tmp_path)
    seen = json.loads(done.stdout)
    # The preloaded modules' objects are frozen (no collection walks them), a run's own cycle is collected.
    assert done.returncode == 0 and seen == {"frozen": seen["frozen"], "collected": True, "decimal_frozen": True}
    assert seen["frozen"] > 1000, seen


def test_a_runs_stderr_ends_as_a_fresh_pythons_without_nanobinds_report_on_the_frozen_preloads(
    warm_python, warm_python_lib, tmp_path
):
    # Triton's nanobind bindings are among the frozen preloads: alive at the run's exit, reported as leaks
    # (a started run's output file keeps the report), which a run's stderr is without.
    source = "import sys, triton; sys.stderr.write('said\\n')"
    started = warm_python.start(["-c", source], output=tmp_path / "out.txt")
    assert started.wait(timeout=120) == 0
    printed = (tmp_path / "out.txt").read_text()
    assert printed.startswith("said\n") and warm_python_lib.NANOBIND_REPORT.search(printed), printed
    done = warm_python.run(["-c", source])
    assert done.returncode == 0 and done.stderr == "said\n", done.stderr[-500:]


def test_only_a_trailing_nanobind_report_is_removed(warm_python_lib):
    report = (
        "nanobind: leaked 64 types!\n - leaked type \"triton._C.libtriton.ir.builder\"\n - ... skipped remainder\n"
        "nanobind: leaked 514 functions!\n - leaked function \"create_clampf\"\n"
        "nanobind: this is likely caused by a reference counting issue in the binding code.\n"
        "See https://nanobind.readthedocs.io/en/latest/refleaks.html"
    )
    strip = warm_python_lib.NANOBIND_REPORT.sub
    assert strip("", "a line\n" + report) == "a line\n" and strip("", report + "\n") == ""
    assert strip("", report + "\nthe run said more\n") == report + "\nthe run said more\n"  # not at the end: kept


def test_a_crash_is_a_signal_and_an_exception_is_exit_code_1(light, tmp_path):
    crashed = light.run(["-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"], env={}, cwd=tmp_path)
    assert crashed.returncode == -signal.SIGILL
    raised = light.run(["-c", "raise ValueError('boom')"], env={}, cwd=tmp_path)
    assert raised.returncode == 1 and "ValueError: boom" in raised.stderr


def spawns_a_sleeper(pid_file: Path, then: str) -> str:
    return (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print('sleeper started', flush=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n" + then
    )


def test_what_a_run_leaves_running_is_killed_when_it_ends(light, tmp_path):
    pid_file = tmp_path / "child.pid"
    assert light.run(["-c", spawns_a_sleeper(pid_file, "")], env=dict(os.environ), cwd=tmp_path).returncode == 0
    assert gone(int(pid_file.read_text()))


def test_a_run_past_its_timeout_is_killed_with_what_it_started_and_the_server_goes_on(light, tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(subprocess.TimeoutExpired, match=r"(?s)after 8 seconds.*its stdout ends:\nsleeper started"):
        light.run(["-c", spawns_a_sleeper(pid_file, "time.sleep(600)\n")], env=dict(os.environ), cwd=tmp_path,
                  timeout=8)  # fmt: skip
    assert gone(int(pid_file.read_text()))
    assert light.run(["-c", "print(7)"], env={}, cwd=tmp_path).stdout == "7\n"


def test_a_started_run_goes_on_beside_other_runs_until_it_ends_or_is_signalled(light, tmp_path):
    waits = "import sys, time\nprint('up', flush=True)\nprint('err', file=sys.stderr, flush=True)\ntime.sleep(600)\n"
    server = light.start(["-c", waits], output=tmp_path / "server.log", cwd=tmp_path)
    ends = light.start(["-c", "import sys; sys.exit(3)"], output=tmp_path / "ends.log", cwd=tmp_path)
    assert light.run(["-c", "print(7)"], env={}, cwd=tmp_path).stdout == "7\n"  # the warm Python goes on
    assert ends.wait(timeout=30) == 3
    deadline = time.monotonic() + 30
    while (tmp_path / "server.log").read_text().count("\n") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.poll() is None and sorted((tmp_path / "server.log").read_text().split()) == ["err", "up"]
    with pytest.raises(subprocess.TimeoutExpired):
        server.wait(timeout=0.2)
    server.terminate()
    assert server.wait(timeout=30) == -signal.SIGTERM and server.returncode == -signal.SIGTERM


def test_what_a_started_run_leaves_and_the_run_itself_end_with_the_warm_python(tmp_path, warm_python_lib):
    warm = warm_python_lib.WarmPython(preload=("json",))
    pid_file = tmp_path / "child.pid"
    try:
        started = warm.start(["-c", spawns_a_sleeper(pid_file, "time.sleep(600)\n")], output=tmp_path / "log")
        deadline = time.monotonic() + 30
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        warm.close()
    assert gone(started.pid) and gone(int(pid_file.read_text()))


def test_a_warm_python_that_fails_takes_its_started_runs_with_it(tmp_path, warm_python_lib):
    warm = warm_python_lib.WarmPython(preload=("json",))
    try:
        started = warm.start(["-c", "import time; time.sleep(600)"], output=tmp_path / "log")
        warm._server.stdin.write("not a request\n")  # the server's loop raises
        warm._server.stdin.flush()
        assert warm._server.wait(timeout=30) != 0 and gone(started.pid)
    finally:
        warm.close()


def test_a_run_whose_warm_python_was_killed_is_signalled_by_pidfd_and_its_end_said_loudly(tmp_path, warm_python_lib):
    warm = warm_python_lib.WarmPython(preload=("json",))
    try:
        started = warm.start(["-c", "import time; time.sleep(600)"], output=tmp_path / "log")
        warm._server.kill()  # no cleanup: the run goes on, its parent gone
        warm._server.wait(timeout=30)
        assert started.poll() is None
        started.kill()
        with pytest.raises(RuntimeError, match="ended, but its warm Python is gone: no exit status"):
            started.wait(timeout=30)
        assert gone(started.pid)
    finally:
        warm.close()


def test_a_fork_starts_as_fresh_only_where_the_variables_read_at_start_are_the_servers(light):
    same = dict(light._env)
    assert light.forks_as_fresh(same | {"VLLM_CPU_KVCACHE_SPACE": "1", "QMC_SAMPLER": "lattice"})
    for name, value in (("PYTHONPATH", "/elsewhere"), ("PYTHONHASHSEED", "7"), ("OMP_NUM_THREADS", "13")):
        assert not light.forks_as_fresh(same | {name: value}), name
    assert not light.forks_as_fresh(same | {"PYTHONSAFEPATH": "1"})


def test_a_run_whose_environment_changes_vllms_logging_gets_it_configured_again(tmp_path, warm_python_lib):
    # A vLLM that configures its logging on import (before 0.32) read the server's environment:
    # a run that asks for another level gets it, as a fresh process would. (A stand-in package
    # named vllm: this release of vLLM configures logging when an engine starts, not on import.)
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "logger.py").write_text(
        "import logging, os\n"
        "def _configure_vllm_root_logger():\n"
        "    logger = logging.getLogger('vllm')\n"
        "    logger.handlers[:] = [logging.StreamHandler()]\n"
        "    logger.setLevel(os.environ.get('VLLM_LOGGING_LEVEL', 'INFO'))\n"
        "_configure_vllm_root_logger()\n"
    )
    env = os.environ | {"PYTHONPATH": str(fake.parent), "VLLM_LOGGING_LEVEL": "ERROR"}
    warm = warm_python_lib.WarmPython(env=env, preload=("logging", "vllm.logger"))
    level = "import logging; print(logging.getLevelName(logging.getLogger('vllm').level))"
    try:
        assert warm.run(["-c", level], env=env).stdout == "ERROR\n"
        assert warm.run(["-c", level], env=env | {"VLLM_LOGGING_LEVEL": "DEBUG"}).stdout == "DEBUG\n"
    finally:
        warm.close()


def test_a_run_that_asks_forks_vllms_processes_instead_of_spawning_them(tmp_path, warm_python_lib):
    # Stand-ins for the modules where vLLM picks its start method; this vLLM's are checked where a
    # suite's server starts them (tests/server/test_data_parallel.py reads it in its log).
    fake = tmp_path / "fake" / "vllm"
    (fake / "v1" / "engine").mkdir(parents=True)
    for folder in (fake, fake / "v1", fake / "v1" / "engine"):
        (folder / "__init__.py").write_text("")
    spawn = "import multiprocessing\ndef get_mp_context():\n    return multiprocessing.get_context('spawn')\n"
    (fake / "v1" / "engine" / "utils.py").write_text(spawn)
    (fake / "v1" / "engine" / "coordinator.py").write_text(spawn)
    env = os.environ | {"PYTHONPATH": str(fake.parent)}
    warm = warm_python_lib.WarmPython(env=env, preload=("vllm.v1.engine.utils", "vllm.v1.engine.coordinator"))
    probe = (
        "import os, vllm.v1.engine.utils as e, vllm.v1.engine.coordinator as c\n"
        "ctx = e.get_mp_context()\n"
        "p = ctx.Process(target=os._exit, args=(3,)); p.start(); p.join()\n"
        "print(ctx.get_start_method(), c.get_mp_context().get_start_method(), p.exitcode, flush=True)\n"
    )
    try:
        forked = warm.start(["-c", probe], output=tmp_path / "forked.log", env=env, fork_engines=True)
        plain = warm.start(["-c", probe], output=tmp_path / "plain.log", env=env)
        assert forked.wait(timeout=60) == 0 and plain.wait(timeout=60) == 0
        assert (tmp_path / "forked.log").read_text().splitlines() == [
            "warm python: vllm.v1.engine.utils starts a process by fork",
            "warm python: vllm.v1.engine.coordinator starts a process by fork",
            "fork fork 3",
        ]
        assert (tmp_path / "plain.log").read_text().splitlines() == ["spawn spawn 3"]  # the server stays as it was
        (fake / "v1" / "engine" / "coordinator.py").write_text("")  # a vLLM that starts them elsewhere
        other = warm_python_lib.WarmPython(env=env, preload=("vllm.v1.engine.coordinator",))
        try:
            failed = other.start(["-c", probe], output=tmp_path / "other.log", env=env, fork_engines=True)
            assert failed.wait(timeout=60) == 1
            assert "vllm.v1.engine.coordinator has no get_mp_context()" in (tmp_path / "other.log").read_text()
        finally:
            other.close()
    finally:
        warm.close()


def test_a_server_that_cannot_start_says_why(warm_python_lib):
    # qmc_sampler itself must never be preloaded: each run imports its own (a mutant's copy, say).
    with pytest.raises(RuntimeError, match=r"(?s)exited \(1\).*AssertionError: preloaded qmc_sampler"):
        warm_python_lib.WarmPython(preload=("json", "qmc_sampler"))


def gone(pid: int, within: float = 10) -> bool:
    """Whether ``pid`` stops running within ``within`` s (a zombie nobody reaps counts as stopped)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False
