"""Fixtures of the benchmark tests."""

import importlib.util
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
