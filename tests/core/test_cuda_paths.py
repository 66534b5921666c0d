"""The GPU paths of the core (``make gpu-check``): the Triton kernel against the torch path on the rows
where the top-k/top-p cut is hard to place, and every member of lattice groups drawn by the core on
the GPU an exact draw of the processed distribution (per-member chi-square over two steps).

Skipped without CUDA. ``QMC_GPU_CHECK_DEVICE=cpu`` (``gpu_check.sh``'s dry run) runs them on the CPU
at small sizes, the kernel through Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton
is imported; the kernel test skips without it). Statistical tests: family-wise α = 1e-3, Bonferroni
over every per-member test in this file (:data:`TESTS`).
"""

import os

import numpy as np
import pytest
import torch

from qmc_sampler import GroupSpec, MemberState, inverse_cdf, process_logits, sample_members
from qmc_sampler.kernels import EDGE_TOLERANCE

#: Where these tests run: CUDA (skipped without it), or the CPU for gpu_check.sh's dry run.
DEVICE = torch.device(os.environ.get("QMC_GPU_CHECK_DEVICE", "cuda"))
ON_GPU = DEVICE.type == "cuda"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: (temperature, top_k, top_p, min_p): off, the common setting, a top-p cut in the middle, a large k.
FILTERS = [(1.0, 0, 1.0, 0.0), (0.8, 50, 0.9, 0.02), (1.0, 0, 0.5, 0.0), (0.7, 1000, 0.95, 0.0)]
ROWS = ["ties", "one value", "flat", "peaked", "ties and -inf"]
G = 8
SETTINGS = {"top-k": (1.3, 10, 1.0, 0.0), "top-p and min-p": (0.9, 0, 0.8, 0.02)}
TESTS = G * len(SETTINGS)
ALPHA = 1e-3 / TESTS


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("vocab", [49152, 151936] if ON_GPU else [1100])
@pytest.mark.parametrize("rows", ROWS)
def test_the_kernel_agrees_with_the_torch_path_where_the_cut_is_hard_to_place(cut_rows_factory, rows, vocab):
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel on the CPU needs Triton's interpreter (TRITON_INTERPRET=1 before Triton is imported)")
    from qmc_sampler.triton_kernels import triton_inverse_cdf

    gen = torch.Generator().manual_seed(vocab + len(rows))
    batch = 32 if ON_GPU else 2
    logits = cut_rows_factory(rows.removesuffix(" and -inf"), batch, vocab, gen)
    if rows.endswith("-inf"):
        logits = logits.masked_fill(torch.rand(batch, vocab, generator=gen) < 0.3, float("-inf"))
        logits[:, 1] = 0.0  # a finite token in every row
    u = torch.rand(batch, dtype=torch.float64, generator=gen)
    u[0], u[-1] = 0.0, 1 - 2.0**-53
    logits, u = on_device(logits, u)
    for temperature, top_k, top_p, min_p in FILTERS if ON_GPU else FILTERS[1:3]:  # the interpreter is slow
        t, k, p, mp = on_device(*(torch.full((batch,), v) for v in (float(temperature), top_k, top_p, min_p)))
        tokens, starts, probs = (x.cpu() for x in triton_inverse_cdf(logits, u, t, mp, k, p))
        ref = inverse_cdf(process_logits(logits, t, k, p, mp), u)
        ref_tokens, ref_starts, ref_probs = ref.tokens.cpu(), ref.starts.cpu(), ref.probs.cpu()
        where = (rows, vocab, temperature, top_k, top_p, min_p)
        same = tokens == ref_tokens
        # Another token only where u lies within rounding of an edge of the reference interval.
        uu = u.cpu()[~same]
        near = torch.minimum((uu - ref_starts[~same]).abs(), (uu - ref_starts[~same] - ref_probs[~same]).abs())
        assert (near < EDGE_TOLERANCE).all(), (where, tokens[~same], ref_tokens[~same])
        assert same.float().mean() > 0.7, where
        # The same kept set: one more or one fewer token at a cut moves the widths by >= 1/(kept tokens).
        np.testing.assert_allclose(probs[same], ref_probs[same], rtol=1e-5, err_msg=str(where))
        np.testing.assert_allclose(starts[same], ref_starts[same], atol=EDGE_TOLERANCE, err_msg=str(where))


def processed(logits: torch.Tensor, setting) -> np.ndarray:
    """The processed distribution of each row, float64 on the CPU (the torch path)."""
    rows = logits.shape[0]
    params = [torch.full((rows,), float(v)) for v in setting]
    return torch.softmax(process_logits(logits.cpu().double(), *params).double(), -1).numpy()


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_each_member_drawn_by_the_core_on_the_device_is_exact_over_two_steps(setting, chi_square_p):
    # A vocabulary of several kernel blocks; the second step's logits depend on the first token
    # (picked on the device); the joint law of both tokens is q1(a)·q2(b | a).
    vocab, groups = (3000, 2000) if ON_GPU else (300, 200)
    gen = torch.Generator().manual_seed(7)
    first = torch.randn(1, vocab, generator=gen) * 0.5 - 3
    hot = torch.randperm(vocab, generator=gen)[:12]
    first[0, hot] = torch.randn(12, generator=gen) * 0.8
    second = torch.randn(vocab, vocab, generator=gen) * 0.5 - 3  # row a: the logits after token a
    second[:, hot] = torch.randn(vocab, 12, generator=gen) * 0.8
    q1 = processed(first, SETTINGS[setting])[0]
    support = np.flatnonzero(q1 > 0)
    joint = np.zeros(vocab * vocab)
    q2 = processed(second[support], SETTINGS[setting])
    for a, row in zip(support, q2, strict=True):
        joint[a * vocab : (a + 1) * vocab] = q1[a] * row

    states = [MemberState(spec=GroupSpec("lattice", G, seed=s), member=i) for s in range(groups) for i in range(G)]
    batch = len(states)
    params = on_device(*(torch.full((batch,), float(v)) for v in SETTINGS[setting]))
    table = second.to(DEVICE)
    step1 = sample_members(first.to(DEVICE).expand(batch, vocab), states, *params)
    assert step1.tokens.device.type == DEVICE.type
    step2 = sample_members(table[step1.tokens], states, *params)  # next logits picked on the device
    a = step1.tokens.cpu().numpy().reshape(groups, G)
    b = step2.tokens.cpu().numpy().reshape(groups, G)
    for group in a:  # every lattice group balanced at the first step
        counts = np.bincount(group, minlength=vocab)
        assert np.all((counts == np.floor(G * q1)) | (counts == np.ceil(G * q1))), (setting, group)
    for member in range(G):
        assert chi_square_p(a[:, member] * vocab + b[:, member], joint) > ALPHA, (setting, member)
