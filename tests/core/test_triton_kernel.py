"""The Triton (CUDA) backend: checked on CPU through Triton's interpreter, and on a GPU where
one is present (skipped cleanly otherwise)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="Triton not installed")

from qmc_sampler import inverse_cdf, process_logits
from qmc_sampler.kernels import EDGE_TOLERANCE, fused_draw


def test_the_kernel_under_tritons_interpreter():
    checks = Path(__file__).with_name("interpreted_triton_checks.py")
    env = os.environ | {"TRITON_INTERPRET": "1", "QMC_SAMPLER_BACKEND": "triton"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", str(checks)],
        capture_output=True,
        text=True,
        env=env,
        cwd=checks.parents[2],
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.cuda
def test_cuda_kernel_agrees_with_the_torch_reference(row_filters):
    gen = torch.Generator().manual_seed(2)
    batch, vocab = 64, 151936
    logits = (torch.randn(batch, vocab, generator=gen) * 3).cuda()
    u = torch.rand(batch, dtype=torch.float64, generator=gen)
    for temperature, top_k, top_p, min_p in [(1.0, 0, 1.0, 0.0), (0.8, 50, 0.9, 0.02)]:
        args = row_filters(batch, temperature, top_k, top_p, min_p)
        got = fused_draw(logits, u, *args, "id")
        ref = inverse_cdf(process_logits(logits.cpu(), *args), u)
        assert (got.tokens.cpu() == ref.tokens).float().mean() > 0.99
        np.testing.assert_allclose(
            got.starts.cpu()[got.tokens.cpu() == ref.tokens],
            ref.starts[got.tokens.cpu() == ref.tokens],
            atol=EDGE_TOLERANCE,
        )


def test_a_launch_uploads_nothing_from_the_host(monkeypatch):
    """Copying a host tensor to a GPU waits for the device (PyTorch synchronises after a copy
    from pageable memory): with every operand on the device, disabled filters included, the
    launch makes no such copy. The 'meta' device stands in for the GPU; the launch is recorded."""
    from qmc_sampler import triton_kernels

    launched = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(args)

    uploads = []
    original_to = torch.Tensor.to

    def recording_to(tensor, *args, **kwargs):
        moved = original_to(tensor, *args, **kwargs)
        if tensor.device.type == "cpu" and moved.device.type != "cpu":
            uploads.append(tuple(tensor.shape))
        return moved

    monkeypatch.setattr(triton_kernels, "_KERNEL", Launcher())
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    meta = torch.device("meta")
    batch = 4
    on_device = {"device": meta}
    triton_kernels.triton_inverse_cdf(
        torch.empty(batch, 1000, **on_device),
        torch.empty(batch, dtype=torch.float64, **on_device),
        torch.empty(batch, **on_device),
        None,
        None,
        None,
    )
    assert len(launched) == 1 and uploads == [], uploads
    assert all(a.device == meta for a in launched[0] if isinstance(a, torch.Tensor))
