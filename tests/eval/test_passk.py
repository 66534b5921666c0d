"""pass@k estimators, against exact values on synthetic groups.

Synthetic problem: a member is correct iff its first-step uniform (code) lies in
a known set S ⊂ [0, 1). Then the true pass@k of a size-k design is computable:
for the lattice, P(some of the k shifted points frac(φ2(i) + Δ) hits S), an
integral over Δ; for i.i.d., 1 − (1 − |S|)^k. The designs' own code functions
generate the groups, so these tests also tie the estimator to the samplers.

Unbiasedness is checked at a stated significance: the mean over R repetitions
must lie within 4 standard errors of the truth (two-sided p ≈ 6e-5 per check).
"""

import numpy as np
import pytest
from qmc_sampler.eval.passk import (
    bootstrap_pass_at_k,
    classical_pass_at_k,
    pass_at_k,
    per_group_pass_at_k,
    samples_saved,
    union_bound,
    valid_ks,
)

from qmc_sampler import get_design

N = 16
REPS = 4000
# Two short intervals half a unit apart: a 16-lattice hits both or neither.
SET = [(0.0, 0.05), (0.5, 0.55)]


def in_set(u: np.ndarray) -> np.ndarray:
    return np.any([(u >= a) & (u < b) for a, b in SET], axis=0)


def groups_of(method: str, reps: int, n: int = N, first_seed: int = 0) -> np.ndarray:
    design = get_design(method)
    seeds = np.repeat(np.arange(first_seed, first_seed + reps, dtype=np.uint64), n)
    members = np.tile(np.arange(n), reps)
    ns = np.full(reps * n, n)
    if design.carries:
        u = design.start_codes(seeds, ns, members)
    else:
        u = design.step_uniforms(seeds, ns, members, np.zeros(reps * n, dtype=np.int64))
    return in_set(u).reshape(reps, n)


def true_lattice_pass_at_k(k: int) -> float:
    delta = (np.arange(200_000) + 0.5) / 200_000  # midpoint rule over the shift
    points = (np.arange(k)[:, None] / k + delta[None, :]) % 1.0
    return float(in_set(points).any(axis=0).mean())


def test_classical_estimator_values():
    assert classical_pass_at_k(10, 0, 3) == 0.0
    assert classical_pass_at_k(10, 8, 3) == 1.0
    assert classical_pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert classical_pass_at_k(4, 1, 2) == pytest.approx(0.5)


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_dyadic_estimator_is_unbiased_for_lattice_groups(k):
    values = per_group_pass_at_k(groups_of("lattice", REPS), k, "lattice")
    truth = true_lattice_pass_at_k(k)
    se = values.std(ddof=1) / np.sqrt(REPS) + 1e-12
    assert abs(values.mean() - truth) < 4 * se + 1e-9, (k, values.mean(), truth)


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_classical_estimator_is_unbiased_for_iid_groups(k):
    values = per_group_pass_at_k(groups_of("iid", REPS), k, "iid")
    truth = 1 - (1 - 0.1) ** k
    se = values.std(ddof=1) / np.sqrt(REPS)
    assert abs(values.mean() - truth) < 4 * se, (k, values.mean(), truth)


def test_the_classical_estimator_is_biased_for_lattice_groups():
    # The reason the dyadic estimator exists: k-subsets of a lattice group are not
    # size-k lattices. Here the truth at k = 2 is 0.1; the classical estimator says ~0.19.
    correct = groups_of("lattice", REPS)
    classical = per_group_pass_at_k(correct, 2, "iid")
    truth = true_lattice_pass_at_k(2)
    se = classical.std(ddof=1) / np.sqrt(REPS)
    assert truth == pytest.approx(0.1, abs=1e-3)
    assert classical.mean() - truth > 10 * se


def test_stratified_and_arithmetic_are_estimated_at_k_equals_n_only():
    correct = groups_of("stratified", 10)
    assert pass_at_k(correct, N, "stratified") >= 0
    with pytest.raises(ValueError, match=r"k=4 is not estimable for design 'stratified'.*use k = N = 16"):
        pass_at_k(correct, 4, "stratified")
    assert valid_ks("arithmetic", 8) == [8]
    assert valid_ks("lattice", 12) == [1, 2, 4]
    assert valid_ks("sobol", 16) == [1, 2, 4, 8, 16]


def test_bad_k_and_shapes_are_rejected():
    with pytest.raises(ValueError, match=r"k=17 must be an integer in \[1, N=16\]"):
        pass_at_k(np.zeros((2, 16), bool), 17, "lattice")
    with pytest.raises(ValueError, match=r"k=3 is not estimable for design 'lattice' with N=16"):
        pass_at_k(np.zeros((2, 16), bool), 3, "lattice")
    with pytest.raises(ValueError, match=r"correct must be a \[groups, N\] bool array"):
        pass_at_k(np.zeros(16, bool), 1, "iid")
    with pytest.raises(ValueError, match=r"design='latice' is not a design"):
        pass_at_k(np.zeros((2, 16), bool), 2, "latice")


def test_union_bound_and_samples_saved():
    assert union_bound([0.1, 0.5], 4) == pytest.approx((0.4 + 1.0) / 2)
    curve = {1: 0.2, 2: 0.4, 4: 0.6, 8: 0.8}
    assert samples_saved(curve, 0.8, 8) == pytest.approx(0.0)
    assert samples_saved(curve, 0.5, 8) == pytest.approx(100 * (1 - 2**1.5 / 8))
    assert samples_saved(curve, 0.9, 8) is None


def test_bootstrap_interval_covers_the_mean_and_shrinks_with_more_problems():
    rng = np.random.default_rng(0)
    few = [rng.random(1) < 0.3 for _ in range(20)]
    many = [rng.random(1) < 0.3 for _ in range(400)]
    a = bootstrap_pass_at_k([f.astype(float) for f in few], 1)
    b = bootstrap_pass_at_k([m.astype(float) for m in many], 1)
    assert a.low <= a.value <= a.high and b.low <= b.value <= b.high
    assert (b.high - b.low) < (a.high - a.low)
