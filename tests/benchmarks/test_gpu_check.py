"""`make gpu-check` (benchmarks/gpu_check.sh) without a GPU: on a machine without CUDA it prints one
line and exits 0; its dry run (QMC_GPU_CHECK_DRY_RUN=1) runs every step's CPU stand-in, so the
script's plumbing — the package from the checkout, the steps, the table — is checked here."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def has_cuda_device() -> bool:
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


@pytest.mark.skipif(has_cuda_device(), reason="this machine has a CUDA device: run make gpu-check itself")
def test_the_gpu_check_skips_cleanly_without_cuda(tmp_path):
    out = tmp_path / "gpu-check"
    # A PATH with only what the skip needs: a script that went on would fail at once, not install.
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "dirname").symlink_to(shutil.which("dirname"))
    done = subprocess.run(
        [shutil.which("bash"), str(SCRIPT)],
        capture_output=True, text=True, timeout=60,
        env={"PATH": str(tools), "QMC_GPU_OUT": str(out), "QMC_GPU_PYTHON": str(tmp_path / "python")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "gpu-check: no CUDA device on this machine; skipped (nothing was run)\n"
    assert not out.exists()


def test_the_dry_run_runs_every_step_on_the_cpu_and_writes_the_table(tmp_path):
    out = tmp_path / "gpu-check"
    env = os.environ | {"QMC_GPU_CHECK_DRY_RUN": "1", "QMC_GPU_PYTHON": sys.executable, "QMC_GPU_OUT": str(out)}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "dry run (QMC_GPU_CHECK_DRY_RUN=1)" in summary and done.stdout.endswith(summary)
    rows = dict(re.findall(r"^([a-z0-9-]+) +(pass|skipped|fail\(\d+\)|timeout) ", summary, re.MULTILINE))
    assert rows == {
        "cuda-tests": "pass", "no-host-syncs": "pass", "sampler-bench": "pass", "hf-throughput": "pass",
        "vllm-mrv2-tests": "skipped", "trl-grpo-test": "skipped", "e2e-v1": "skipped", "e2e-mrv2-async": "skipped",
    }, summary  # fmt: skip
    # The CUDA tests really ran on their CPU stand-ins (the kernel's only where Triton's interpreter works).
    ran = int(re.search(r"^cuda-tests .* (\d+) passed", summary, re.MULTILINE).group(1))
    assert ran >= 5, summary
    assert re.search(r"^no-host-syncs .* 6 passed", summary, re.MULTILINE), summary
    assert "summary (cpu, 4 rows" in summary and "lattice/plain tokens/s ratio = " in summary
    assert {p.name for p in out.iterdir()} == {
        "env.txt", "summary.txt", "cuda-tests.log", "no-host-syncs.log", "sampler-bench.log", "hf-throughput.log",
    }  # fmt: skip
