"""Marginal exactness: every member of every design is an exact draw from the processed model.

For each design, sampling configuration and member index, the joint distribution of
the member's first three tokens over many independent groups is compared with the
exact processed joint (64 cells) by a chi-square test, on every CPU sampling
backend (the fused C++ kernel and the pure-torch path; Triton has its own file).

With vocabulary 4 and N = 4 most lattice members are alone (prefix width below
1/N) after one token, so the carry is barely exercised there. A second test
therefore follows members of a group so large (N = 2^30; stratified, which has no
alone width, at N = 4) that its members carry their code until the precision
floor — about 15 steps of a flattened 4-token Markov model — and compares
windows of their sequences deep inside the carry with the exact joint.

Significance: family-wise α = 1e-3, Bonferroni over every chi-square test in this file.
Tokens of probability zero must never appear (checked exactly).
"""

import itertools
import warnings

import numpy as np
import pytest
import torch

from qmc_sampler import METHODS, GroupSpec, MemberState, sample_members
from qmc_sampler.kernels import _cpp_kernel

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
BACKENDS = [b for b in ("cpp", "torch") if b != "cpp" or _cpp_kernel() is not None]
LONG_CARRY_DESIGNS = ("lattice", "arithmetic", "stratified")
LONG_CARRY_WINDOWS = (0, 4, 8)
LONG_CARRY_MEMBERS = (0, 1, 2**29 + 3, 123_456_789)
ALPHA = 1e-3 / (len(CASES) * N * len(BACKENDS) + len(LONG_CARRY_DESIGNS) * len(LONG_CARRY_WINDOWS) * 2)


def exact_joint(model, processed_reference, config) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(model.vocab), repeat=STEPS):
        p = 1.0
        for t in range(STEPS):
            q = processed_reference(model.table[seq[:t]].numpy(), **config)
            p *= q[seq[t]]
        joint[seq] = p
    return joint


def observed_and_expected(observed: dict, expected_probs: dict, total: int) -> tuple[np.ndarray, np.ndarray]:
    """The observed and expected counts of the cells of ``expected_probs``, likeliest first (for
    ``pooled_chi_square_p``, which pools the cells expected fewer than 5 times)."""
    cells = sorted(expected_probs, key=lambda c: expected_probs[c], reverse=True)
    exp = np.array([expected_probs[c] * total for c in cells])
    obs = np.array([observed.get(c, 0) for c in cells], dtype=float)
    return obs, exp


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("method", "config", "order"), CASES)
def test_each_member_draws_from_the_processed_model(
    toy_model, processed_reference, group_runner, method, config, order, backend, monkeypatch, pooled_chi_square_p
):
    monkeypatch.setenv("QMC_SAMPLER_BACKEND", backend)
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
        p = pooled_chi_square_p(*observed_and_expected(counts, support, GROUPS))
        assert p > ALPHA, f"{method}/{config}/{order} member {member}: chi-square p = {p:.2e}"


def markov_model(vocab: int = 4, seed: int = 7) -> np.ndarray:
    """Transition probabilities ``[vocab + 1, vocab]`` (row ``vocab``: the first step), flattened (T = 2)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(vocab + 1, vocab)) * 1.5 / 2.0
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("method", LONG_CARRY_DESIGNS)
def test_long_carries_stay_exact(method, pooled_chi_square_p):
    q = markov_model()
    vocab, steps, groups = q.shape[1], 12, 3000
    log_q = torch.tensor(np.log(q), dtype=torch.float32)
    # A huge group keeps lattice and arithmetic members above their alone width; stratified
    # has none (it carries to the floor at any n) and its permutation is O(n), so n = 4.
    n, members = (4, (0, 1, 2, 3)) if method == "stratified" else (2**30, LONG_CARRY_MEMBERS)
    states = [MemberState(spec=GroupSpec(method, n, seed=g), member=m) for g in range(groups) for m in members]
    rows = len(states)
    tokens = np.empty((rows, steps), dtype=np.int64)
    carrying = []
    previous = np.full(rows, vocab)
    for t in range(steps):
        draw = sample_members(log_q[previous], states, torch.ones(rows))
        tokens[:, t] = previous = draw.tokens.numpy()
        carrying.append(np.mean([not s.fresh for s in states]))
    # The carry really is exercised: most members still carry their code at step 10.
    assert carrying[10] > 0.5, carrying
    for start in LONG_CARRY_WINDOWS:
        # P(y_start, y_start+1, y_start+2): the marginal of y_start by the chain, then two transitions.
        marginal = q[vocab]
        for _ in range(start):
            marginal = marginal @ q[:vocab]  # rows of q[:vocab]: P(next | previous)
        joint = {(a, b, c): marginal[a] * q[a, b] * q[b, c] for a, b, c in itertools.product(range(vocab), repeat=3)}
        for member in range(len(members)):
            window = tokens[member :: len(members), start : start + 3]
            counts: dict[tuple[int, ...], int] = {}
            for seq in map(tuple, window.tolist()):
                counts[seq] = counts.get(seq, 0) + 1
            p = pooled_chi_square_p(*observed_and_expected(counts, joint, groups))
            assert p > ALPHA, f"{method} member {members[member]} steps {start}..{start + 2}: p = {p:.2e}"
