"""Lattice structure, exactly: prefix counts are ⌊n·P⌋ or ⌈n·P⌉ (qmc-math.md §2–3)."""

import math

import numpy as np
import pytest
import torch

from qmc_sampler import GroupSpec, MemberState, process_logits, sample_members


def first_token_counts(logits: torch.Tensor, spec: GroupSpec, **sampling) -> np.ndarray:
    states = [MemberState(spec=spec, member=i) for i in range(spec.n)]
    rows = logits.expand(spec.n, -1)
    params = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | sampling
    draw = sample_members(
        rows,
        states,
        torch.full((spec.n,), params["temperature"]),
        torch.full((spec.n,), params["top_k"]),
        torch.full((spec.n,), params["top_p"]),
        torch.full((spec.n,), params["min_p"]),
    )
    return np.bincount(draw.tokens.numpy(), minlength=logits.shape[-1])


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 16, 64, 100])
@pytest.mark.parametrize("order", ["id", "sorted"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.01}])
def test_first_token_counts_are_floor_or_ceil_of_n_q(n, order, sampling):
    for seed in range(25):
        logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(seed)) * 2
        q = torch.softmax(
            process_logits(
                logits,
                torch.tensor([sampling.get("temperature", 1.0)]),
                torch.tensor([sampling.get("top_k", 0)]),
                torch.tensor([sampling.get("top_p", 1.0)]),
                torch.tensor([sampling.get("min_p", 0.0)]),
            ).double(),
            -1,
        )[0].numpy()
        counts = first_token_counts(logits, GroupSpec("lattice", n, seed, order=order), **sampling)
        nq = n * q
        assert np.all((counts == np.floor(nq)) | (counts == np.ceil(nq))), (seed, counts, nq)


def test_two_token_prefix_counts_are_floor_or_ceil(toy_model, processed_reference, group_runner):
    n = 16
    for seed in range(40):
        seqs = group_runner(toy_model, [GroupSpec("lattice", n, seed)], steps=2)[0]
        for a in range(4):
            qa = processed_reference(toy_model.table[()].numpy(), 1.0, 0, 1.0, 0.0)[a]
            qb = processed_reference(toy_model.table[(a,)].numpy(), 1.0, 0, 1.0, 0.0)
            for b in range(4):
                count = int(np.sum((seqs[:, 0] == a) & (seqs[:, 1] == b)))
                nP = n * qa * qb[b]
                assert count in (math.floor(nP), math.ceil(nP)), (seed, a, b, count, nP)


def test_i_i_d_is_not_balanced_which_is_why_lattice_exists():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 2
    q = torch.softmax(logits.double(), -1)[0].numpy()
    violations = 0
    for seed in range(25):
        counts = first_token_counts(logits, GroupSpec("iid", 64, seed))
        nq = 64 * q
        violations += int(not np.all((counts == np.floor(nq)) | (counts == np.ceil(nq))))
    assert violations >= 20
