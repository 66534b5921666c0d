"""Checks of the Triton kernel under Triton's CPU interpreter.

Not collected by the main run (the file name does not start with ``test_``):
``test_triton_kernel.py`` runs it in a fresh pytest process with
``TRITON_INTERPRET=1`` set before anything imports Triton, which the interpreter
requires (Triton binds its language builtins at import).
"""

import numpy as np
import pytest
import torch

import qmc_sampler.triton_kernels as tk
from qmc_sampler import GroupSpec, inverse_cdf, process_logits
from qmc_sampler.kernels import EDGE_TOLERANCE, fused_draw


@pytest.fixture
def interpreted(monkeypatch):
    """Force the Triton backend (the process runs with TRITON_INTERPRET=1)."""
    monkeypatch.setenv("QMC_SAMPLER_BACKEND", "triton")
    monkeypatch.setattr(tk, "_KERNEL", None)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"), [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.05), (1.2, 10, 0.9, 0.0)]
)
def test_interpreted_kernel_agrees_with_the_torch_reference(interpreted, temperature, top_k, top_p, min_p, row_filters):
    gen = torch.Generator().manual_seed(1)
    batch, vocab = 6, 2500
    logits = torch.randn(batch, vocab, generator=gen) * 3
    logits[:, 7:40] = float("-inf")
    u = torch.rand(batch, dtype=torch.float64, generator=gen)
    u[0], u[1] = 0.0, 1 - 2.0**-53
    args = row_filters(batch, temperature, top_k, top_p, min_p)
    got = fused_draw(logits, u, *args, "id")
    ref = inverse_cdf(process_logits(logits, *args), u)
    assert torch.equal(got.tokens, ref.tokens)
    np.testing.assert_allclose(got.starts, ref.starts, atol=EDGE_TOLERANCE)
    np.testing.assert_allclose(got.probs, ref.probs, atol=EDGE_TOLERANCE)


def test_interpreted_kernel_rejects_bad_rows(interpreted):
    logits = torch.zeros(2, 300)
    logits[1] = float("nan")
    with pytest.raises(ValueError, match="row 1 has NaN or no admissible token"):
        fused_draw(logits, torch.full((2,), 0.5, dtype=torch.float64), torch.ones(2), None, None, None, "id")


def test_interpreted_kernel_keeps_lattice_groups_balanced(interpreted, group_runner, toy_factory):
    model = toy_factory(vocab=8, depth=2, seed=5, scale=1.0)
    q = torch.softmax(model.table[()].double(), -1).numpy()
    seqs = group_runner(model, [GroupSpec("lattice", 8, seed=s) for s in range(20)], steps=1)
    for group in seqs:
        counts = np.bincount(group[:, 0], minlength=8)
        assert np.all((counts == np.floor(8 * q)) | (counts == np.ceil(8 * q)))


def test_interpreted_kernel_is_the_inverse_cdf_at_every_uniform(interpreted):
    # Exactness rests on the token being F⁻¹(u) for the member's U[0,1) uniform: on a grid of
    # 512 uniforms (every interval of this 12-token row is hit, most many times) the
    # kernel's token, interval start and width equal the reference's. (A chi-square through
    # the interpreter needs thousands of one-row programs per step; the members' uniforms are
    # tested where they are made.)
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(9)).repeat(512, 1)
    u = (torch.arange(512, dtype=torch.float64) + 0.5) / 512
    reference = inverse_cdf(process_logits(logits, torch.full((512,), 1.5)), u)
    got = fused_draw(logits, u, torch.full((512,), 1.5), None, None, None, "id")
    assert torch.equal(got.tokens, reference.tokens)
    np.testing.assert_allclose(got.starts, reference.starts, atol=EDGE_TOLERANCE)
    np.testing.assert_allclose(got.probs, reference.probs, atol=EDGE_TOLERANCE)
    assert set(got.tokens.tolist()) == set(range(12))


@pytest.mark.parametrize(
    ("case", "top_k", "min_p"),
    [("ties", 0, 0.0), ("ties", 400, 0.0), ("one value", 0, 0.0), ("flat", 0, 0.0), ("peaked", 30, 0.02)],
)
def test_interpreted_top_k_and_top_p_without_sorting_keep_the_reference_set(
    interpreted, cut_rows_factory, case, top_k, min_p
):
    # Six distinct logits (ties): the top-p cut and the k-th largest fall inside tie groups,
    # where the larger ids are kept first; p from almost 0 to almost 1, one per row.
    gen = torch.Generator().manual_seed(11)
    batch, vocab = 12, 1000
    logits = cut_rows_factory(case, batch, vocab, gen)
    u = torch.rand(batch, dtype=torch.float64, generator=gen)
    top_p = torch.rand(batch, generator=gen).clamp(1e-3, 0.999)
    top_p[0] = 1.0
    args = (torch.full((batch,), 0.8), torch.full((batch,), top_k), top_p, torch.full((batch,), min_p))
    got = fused_draw(logits, u, *args, "id")
    ref = inverse_cdf(process_logits(logits, *args), u)
    assert torch.equal(got.tokens, ref.tokens)
    np.testing.assert_allclose(got.starts, ref.starts, atol=EDGE_TOLERANCE)
    np.testing.assert_allclose(got.probs, ref.probs, atol=EDGE_TOLERANCE)
