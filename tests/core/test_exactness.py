"""Marginal exactness: every member of every design is an exact draw from the processed model.

For each design, sampling configuration and member index, the joint distribution of
the member's first three tokens over many independent groups is compared with the
exact processed joint (64 cells) by a chi-square test, on every sampling backend.
Significance: family-wise α = 1e-3, Bonferroni over every (design, config, member,
backend) test in this file.
Tokens of probability zero must never appear (checked exactly).
"""

import itertools
import warnings

import numpy as np
import pytest
from scipy import stats

from qmc_sampler import METHODS, GroupSpec

GROUPS = 3000
N = 4
STEPS = 3
CONFIGS = {
    "plain": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "temperature": dict(temperature=0.6, top_k=0, top_p=1.0, min_p=0.0),
    "top_k": dict(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0),
    "top_p": dict(temperature=1.2, top_k=0, top_p=0.8, min_p=0.0),
    "min_p": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2),
    "all": dict(temperature=0.9, top_k=3, top_p=0.9, min_p=0.05),
}
CASES = [(m, c, o) for m in METHODS for c in CONFIGS for o in ("id",)] + [(m, "plain", "sorted") for m in METHODS]
ALPHA = 1e-3 / (len(CASES) * N * 2)  # two backends


def exact_joint(model, processed_reference, config) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(model.vocab), repeat=STEPS):
        p = 1.0
        for t in range(STEPS):
            q = processed_reference(model.table[seq[:t]].numpy(), **config)
            p *= q[seq[t]]
        joint[seq] = p
    return joint


def chi_square_pvalue(observed: dict, expected_probs: dict, total: int) -> float:
    cells = sorted(expected_probs, key=lambda c: expected_probs[c], reverse=True)
    exp = np.array([expected_probs[c] * total for c in cells])
    obs = np.array([observed.get(c, 0) for c in cells], dtype=float)
    # Pool the rare cells (expected < 5) into one, as the chi-square approximation requires.
    rare = exp < 5
    if rare.any():
        exp = np.append(exp[~rare], exp[rare].sum())
        obs = np.append(obs[~rare], obs[rare].sum())
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize(("method", "config", "order"), CASES)
def test_each_member_draws_from_the_processed_model(
    toy_model, processed_reference, group_runner, method, config, order
):
    joint = exact_joint(toy_model, processed_reference, CONFIGS[config])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        specs = [
            GroupSpec(method, N, seed=1_000_003 * list(CONFIGS).index(config) + g, order=order) for g in range(GROUPS)
        ]
    seqs = group_runner(toy_model, specs, STEPS, **CONFIGS[config])
    for member in range(N):
        counts: dict[tuple[int, ...], int] = {}
        for seq in map(tuple, seqs[:, member, :].tolist()):
            counts[seq] = counts.get(seq, 0) + 1
        impossible = [s for s in counts if joint[s] == 0.0]
        assert not impossible, f"member {member} drew zero-probability sequences {impossible}"
        support = {s: p for s, p in joint.items() if p > 0}
        p = chi_square_pvalue(counts, support, GROUPS)
        assert p > ALPHA, f"{method}/{config}/{order} member {member}: chi-square p = {p:.2e}"
