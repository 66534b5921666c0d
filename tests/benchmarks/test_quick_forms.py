"""Every benchmark with a quick form runs it on this CPU (a crash, e.g. SIGILL from a kernel
library built for another CPU, is a red test)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")

pytestmark = pytest.mark.vllm
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_sampler_benchmark_quick_form_runs_on_this_cpu():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "sampler_bench.py"), "--quick", "--repeats", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.strip().startswith("32 ")]
    assert len(rows) == 8, done.stdout  # batch 32 × two vocabularies × four filters


def test_the_rollout_benchmark_quick_form_runs_both_paths():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "rollout_diversity.py"), "--quick"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\nCPU: " in "\n" + done.stdout  # the CPU is named
    for path in ("vllm (", "hf ("):
        assert path in done.stdout, done.stdout
    assert done.stdout.count("(lattice / i.i.d.)") == 2


def test_the_reproducibility_benchmark_quick_form_runs():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "reproducibility.py"), "--quick"], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\nCPU: " in "\n" + done.stdout  # the CPU is named
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["iid"], ["lattice"])]
    assert len(rows) == 2 and all(0.0 <= float(r[1]) <= 1.0 for r in rows), done.stdout
