"""`make gpu-check` on a machine without CUDA: one line, exit 0, nothing run or written."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
        [shutil.which("bash"), str(ROOT / "benchmarks" / "gpu_check.sh")],
        capture_output=True, text=True, timeout=60,
        env={"PATH": str(tools), "QMC_GPU_OUT": str(out), "QMC_GPU_VENV": str(tmp_path / "venv")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "gpu-check: no CUDA device on this machine; skipped (nothing was run)\n"
    assert not out.exists() and not (tmp_path / "venv").exists()
