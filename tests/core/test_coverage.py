"""What correlation buys: lattice pass@n reaches the union bound min(1, n·p), i.i.d. does not.

Toy task: a problem is a 2-step model over 8 tokens whose correct answers are the
sequences starting with one "right" token (the one with p nearest 0.1) (an interval of code space in id order,
the case where the lattice hits the bound exactly, qmc-math.md §3). pass@n is
estimated over 2000 groups per problem; with n = 8 its standard error is ≤ 0.011,
so the 5% margins below are ≥ 3 standard errors wide.
"""

import numpy as np
import torch
from scipy import stats

from qmc_sampler import GroupSpec

GROUPS = 2000
N = 8


def pass_at_n(toy_factory, group_runner, method: str, seed: int) -> tuple[float, float]:
    model = toy_factory(vocab=8, depth=2, seed=seed, scale=1.0)
    probs = torch.softmax(model.table[()].double(), -1)
    right = int(torch.argmin((probs - 0.1).abs()))  # p near 0.1: where i.i.d. falls well short
    p = float(probs[right])
    specs = [GroupSpec(method, N, seed=1_000 * seed + g) for g in range(GROUPS)]
    seqs = group_runner(model, specs, steps=2)
    solved = (seqs[:, :, 0] == right).any(axis=1)
    return float(solved.mean()), p


def test_lattice_reaches_the_union_bound_and_beats_iid(toy_factory, group_runner):
    for seed in range(4):
        lattice, p = pass_at_n(toy_factory, group_runner, "lattice", seed)
        iid, _ = pass_at_n(toy_factory, group_runner, "iid", seed)
        bound = min(1.0, N * p)
        assert lattice >= 0.95 * bound, (seed, lattice, bound)
        assert lattice > iid + 0.05 * bound, (seed, lattice, iid)
        assert abs(iid - (1 - (1 - p) ** N)) < 0.05, (seed, iid, p)


def test_every_exact_design_has_the_models_per_sample_rate(toy_factory, group_runner):
    # The target token has q ≈ 0.3, and each design's rate is z-tested against it with the
    # standard error of per-group means (members of a group are correlated, groups are
    # not). Family-wise α = 1e-3, Bonferroni over the 6 designs.
    model = toy_factory(vocab=8, depth=2, seed=0, scale=1.0)
    probs = torch.softmax(model.table[()].double(), -1).numpy()
    right = int(np.argmin(np.abs(probs - 0.3)))
    assert 0.2 < probs[right] < 0.4
    z_crit = stats.norm.isf(1e-3 / (2 * 6))
    for method in ("iid", "lattice", "stratified", "arithmetic", "sobol", "antithetic"):
        seqs = group_runner(model, [GroupSpec(method, N, seed=g) for g in range(GROUPS)], steps=1)
        per_group = (seqs[:, :, 0] == right).mean(axis=1)
        se = max(per_group.std(ddof=1), 1.0 / N) / np.sqrt(GROUPS)  # a floor for near-deterministic lattices
        z = (per_group.mean() - probs[right]) / se
        assert abs(z) < z_crit, (method, per_group.mean(), probs[right], z)
