"""Fixtures of the benchmark tests."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="session")
def benchmark_script():
    """``benchmark_script(name)``: ``benchmarks/NAME.py`` as a module, loaded once per name (importing a
    benchmark runs nothing: its ``main`` is behind ``__name__ == "__main__"``)."""
    loaded = {}

    def load(name: str):
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCHMARKS / f"{name}.py")
            loaded[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(loaded[name])
        return loaded[name]

    return load


@pytest.fixture(scope="session")
def quick_record(warm_python, tiny_model_dir):
    """``quick_record(name, out, records, *extra)``: ``benchmarks/NAME.py --quick EXTRA`` on the tiny model
    into ``out``, in a fork of the warm Python; asserts it succeeded and returns (its argv, the finished
    process, the records of ``out / records``, a JSONL file)."""

    def run(name: str, out: Path, records: str, *extra: str):
        argv = ("--quick", "--model", tiny_model_dir, "--out", str(out), *extra)
        done = warm_python.run([str(BENCHMARKS / f"{name}.py"), *argv], cwd=BENCHMARKS, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return argv, done, [json.loads(line) for line in (out / records).read_text().splitlines()]

    return run


@pytest.fixture(scope="session")
def refused(warm_python):
    """``refused(name, argv, out, records, message)``: ``benchmarks/NAME.py ARGV --out OUT`` exits 2 with
    one line naming ``message`` and writes no ``out / records``."""

    def run(name: str, argv: list[str], out: Path, records: str, message: str) -> None:
        done = warm_python.run([str(BENCHMARKS / f"{name}.py"), *argv, "--out", str(out)], cwd=BENCHMARKS, timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr
        assert not (out / records).exists()

    return run
