"""tests/warm_python.py: a fork per run behaves as a fresh ``python -P`` would."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("warm_python", Path(__file__).with_name("warm_python.py"))
warm_python_module = sys.modules.setdefault("warm_python", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(warm_python_module)


@pytest.fixture(scope="module")
def light():
    """A warm Python that preloads only the standard library (the protocol, not the imports)."""
    server = warm_python_module.WarmPython(preload=("json", "decimal"))
    try:
        yield server
    finally:
        server.close()


def test_a_run_gets_its_argv_environment_directory_and_path_and_its_exit_code(light, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv, 'env': os.environ.get('PROBE'), 'cwd': os.getcwd(),\n"
        "                  'first': sys.path[:2], 'decimal_loaded': 'decimal' in sys.modules}))\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    (tmp_path / "extra").mkdir()
    done = light.run([str(script), "a", "b"], env={"PROBE": "yes"}, cwd=tmp_path / "extra", path_first=("/nowhere",))
    seen = json.loads(done.stdout)
    assert done.returncode == 3 and done.stderr == "to stderr\n"
    assert seen["argv"] == [str(script), "a", "b"] and seen["env"] == "yes"
    assert seen["cwd"] == str(tmp_path / "extra") and seen["first"] == [str(tmp_path), "/nowhere"]
    assert seen["decimal_loaded"]  # preloaded once, before the fork


def test_modules_and_sources_run_as_python_m_and_c(light, tmp_path):
    by_module = light.run(["-m", "platform", "--terse"], env={}, cwd=tmp_path)
    assert by_module.returncode == 0 and by_module.stdout.strip(), by_module.stderr
    by_source = light.run(["-c", "import sys; print(sys.argv); raise SystemExit('bad')", "x"], env={}, cwd=tmp_path)
    assert by_source.stdout == "['-c', 'x']\n" and by_source.returncode == 1 and "bad" in by_source.stderr


def test_a_crash_is_a_signal_and_an_exception_is_exit_code_1(light, tmp_path):
    crashed = light.run(["-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"], env={}, cwd=tmp_path)
    assert crashed.returncode == -signal.SIGILL
    raised = light.run(["-c", "raise ValueError('boom')"], env={}, cwd=tmp_path)
    assert raised.returncode == 1 and "ValueError: boom" in raised.stderr


def test_a_run_past_its_timeout_is_killed_with_what_it_started_and_the_server_goes_on(light, tmp_path):
    pid_file = tmp_path / "child.pid"
    source = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        light.run(["-c", source], env=dict(os.environ), cwd=tmp_path, timeout=5)
    started = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(started) and time.monotonic() < deadline:  # killed with its group
        time.sleep(0.1)
    assert not alive(started)
    assert light.run(["-c", "print(7)"], env={}, cwd=tmp_path).stdout == "7\n"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a parent that does not reap it does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")
