"""Every benchmark's quick form runs on this CPU (a crash, e.g. SIGILL from a kernel library
built for another CPU, is a red test). The engine benchmarks run on the tiny test model: the
point is that each one runs here, not its figures. Each runs as ``python SCRIPT`` in a fresh
interpreter: a fork of the warm one (``tests/warm_python.py``), torch and vLLM already imported."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed")

pytestmark = pytest.mark.vllm
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_sampler_benchmark_quick_form_runs_on_this_cpu(warm_python):
    # One vocabulary (the kernels take any; make gpu-check's dry run takes another, 1100).
    argv = [str(BENCHMARKS / "sampler_bench.py"), "--quick", "--repeats", "1", "--vocabs", "49152"]
    done = warm_python.run(argv, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.strip().startswith("32 ")]
    assert len(rows) == 4, done.stdout  # batch 32 × four filters
    assert "CPU: " in done.stdout  # every timing names its CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_sampler_benchmark_on_cuda_refuses_a_machine_without_one(warm_python):
    done = warm_python.run([str(BENCHMARKS / "sampler_bench.py"), "--device", "cuda"],
                           cwd=BENCHMARKS.parent, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--device cuda: this machine has no CUDA device" in done.stderr, done.stderr


def quick(warm_python, script: str, model_dir: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    # env: conftest's engine_core_env. No process of its own for the model: a vllm.LLM's engine
    # core runs in the script (it starts in ~3 s, not ~17 s), a server's model in its engine core.
    done = warm_python.run([str(BENCHMARKS / script), "--quick", "--model", model_dir, *extra], env=env,
                           cwd=BENCHMARKS.parent, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def test_the_rollout_benchmark_quick_form_runs_both_paths(tiny_model_dir, engine_core_env, warm_python, tmp_path):
    out = tmp_path / "groups.jsonl"
    done = quick(warm_python, "rollout_diversity.py", tiny_model_dir, engine_core_env, "--out", str(out))
    assert "\nCPU: " in "\n" + done.stdout  # the CPU is named
    for path in ("vllm (", "hf ("):
        assert path in done.stdout, done.stdout
    assert done.stdout.count("(lattice / i.i.d.)") == 2
    header, *groups = [json.loads(line) for line in out.read_text().splitlines()]  # the data behind the table
    assert header["cpu"].startswith("CPU: ") and header["args"]["quick"] is True
    keys = sorted((g["backend"], g["sampler"], g["problem_id"]) for g in groups)
    assert len(keys) == len(set(keys)) == 2 * 2 * 4 and {len(g["rewards"]) for g in groups} == {4}


def test_the_reproducibility_benchmark_quick_form_runs(tiny_model_dir, engine_core_env, warm_python):
    done = quick(warm_python, "reproducibility.py", tiny_model_dir, engine_core_env)
    assert "\nCPU: " in "\n" + done.stdout  # the CPU is named
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["iid"], ["lattice"])]
    assert len(rows) == 2 and all(0.0 <= float(r[1]) <= 1.0 for r in rows), done.stdout


def test_the_end_to_end_overhead_quick_form_runs(tiny_model_dir, engine_core_env, warm_python):
    done = quick(warm_python, "e2e_overhead.py", tiny_model_dir, engine_core_env)
    assert "\nCPU: " in "\n" + done.stdout and "throughput ratio lattice/plain = " in done.stdout, done.stdout


def test_the_server_load_quick_form_runs_both_servers(tiny_model_dir, engine_core_env, warm_python):
    done = quick(warm_python, "server_load.py", tiny_model_dir, engine_core_env)
    assert "\nCPU: " in "\n" + done.stdout and "qmc-serve / vLLM's server = " in done.stdout, done.stdout
    assert "burst: only the expected 429s" in done.stdout


def test_the_fleet_scaling_quick_form_runs_the_endpoint_fleet(tiny_model_dir, engine_core_env, warm_python):
    pytest.importorskip("ray.data.llm", reason="ray extra not installed")
    # The --endpoint fleet on 1 and 2 replicas, side by side; no Ray run in the quick form (the Ray
    # backend's replicas are tests/eval/backends/test_ray.py's).
    done = quick(warm_python, "fleet_scaling.py", tiny_model_dir, engine_core_env | {"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert "\nCPU: " in "\n" + done.stdout and "every group complete: True" in done.stdout, done.stdout
    table = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["--endpoint"], ["--ray"])]
    rows = [(row[0], row[1]) for row in table]
    assert rows == [("--endpoint", "1"), ("--endpoint", "2")], done.stdout
    assert re.search(r"^ratio 2 / 1 replicas, --endpoint: \d+\.\d\dx groups/s$", done.stdout, re.MULTILINE), done.stdout
    assert "ratio 2 / 1 replicas, --ray: not measured (replicas [])" in done.stdout


def test_the_fleet_scaling_replica_counts_are_checked_before_any_server_starts(warm_python):
    done = warm_python.run([str(BENCHMARKS / "fleet_scaling.py"), "--ray-replicas", "3"], cwd=BENCHMARKS.parent)
    assert done.returncode == 2 and "argument --ray-replicas: '3': give 1, 2 or 1,2" in done.stderr, done.stderr


def test_the_parked_members_benchmark_quick_form_runs_side_by_side(warm_python):
    done = warm_python.run([str(BENCHMARKS / "parked_members.py"), "--quick"], cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\nCPU: " in "\n" + done.stdout and "parked / with none: hot " in done.stdout, done.stdout
    rows = {r[0]: r for r in (line.split() for line in done.stdout.splitlines()) if r and r[-1].endswith("x")}
    assert set(rows) == {"empty", "hot", "spread"}, done.stdout  # one process, the three registries
    assert int(rows["empty"][1]) < 2000 <= int(rows["hot"][1]) and 2000 <= int(rows["spread"][1]), done.stdout
