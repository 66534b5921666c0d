"""pass@k estimators, against exact values on synthetic groups.

Synthetic problem: a member is correct iff its first uniform (its code, for carry
designs) lies in a known set S ⊂ [0, 1) — or, for ``sobol``, iff its first two
coordinates lie in a known box, which exercises the two-dimensional net. The
true pass@k of the size-k design is then known:

* ``lattice``: P(some of k shifted points frac(j/k + Δ) hits S), integrated over Δ;
* ``antithetic``: pairs (u, 1 − u) hit S with probability |S ∪ (1 − S)|;
* ``sobol``: the first k points of independently scrambled nets (Monte Carlo);
* ``stratified`` / ``arithmetic`` (k = N only): integrals over the design's randomness;
* ``iid``: 1 − (1 − |S|)^k.

The designs' own code functions generate the groups, so these tests also tie
the estimator to the samplers. Unbiasedness: over R groups, the z-score of the
estimate's mean against the truth. Significance: family-wise α = 1e-3,
Bonferroni over every (design, N, k) z-test in this file (two-sided).
"""

import numpy as np
import pytest
from qmc_sampler.eval.stats.passk import (
    bootstrap_pass_at_k,
    bootstrap_samples_saved,
    bounded_mean_interval,
    bounded_ratio_interval,
    classical_pass_at_k,
    median_interval,
    pass_at_k,
    per_group_pass_at_k,
    samples_saved,
    sub_designs,
    union_bound,
    valid_ks,
)
from scipy import stats

from qmc_sampler import get_design

REPS = 4000
INTERVAL = [(0.0, 0.1)]  # the example: true lattice pass@k = min(1, 0.1·k)
TWO = [(0.0, 0.05), (0.5, 0.55)]  # a 2^m-lattice hits both or neither
BOX = (0.0, 0.3, 0.0, 0.4)  # sobol: correct iff u0 < 0.3 and u1 < 0.4
CASES = [
    (design, n, k)
    for design, ns in (("lattice", (16, 12, 5)), ("sobol", (16, 12, 5)), ("antithetic", (16, 12, 5)))
    for n in ns
    for k in valid_ks(design, n)
]
Z_CRIT = stats.norm.isf(1e-3 / (2 * (len(CASES) + 4)))  # + stratified, arithmetic, and two iid checks


def in_set(u: np.ndarray, intervals) -> np.ndarray:
    return np.any([(u >= a) & (u < b) for a, b in intervals], axis=0)


def uniforms(method: str, reps: int, n: int, step: int = 0, first_seed: int = 0) -> np.ndarray:
    """``[reps, n]`` first-step codes (carry designs) or step-``step`` uniforms of ``reps`` groups."""
    design = get_design(method)
    seeds = np.repeat(np.arange(first_seed, first_seed + reps, dtype=np.uint64), n)
    members = np.tile(np.arange(n), reps)
    ns = np.full(reps * n, n)
    if design.carries:
        u = design.start_codes(seeds, ns, members)
    else:
        u = design.step_uniforms(seeds, ns, members, np.full(reps * n, step, dtype=np.int64))
    return u.reshape(reps, n)


def correct(method: str, reps: int, n: int, first_seed: int = 0) -> np.ndarray:
    if method == "sobol":
        u0, u1 = uniforms(method, reps, n, 0, first_seed), uniforms(method, reps, n, 1, first_seed)
        return (u0 >= BOX[0]) & (u0 < BOX[1]) & (u1 >= BOX[2]) & (u1 < BOX[3])
    return in_set(uniforms(method, reps, n, first_seed=first_seed), INTERVAL if method == "lattice" else TWO)


def shifted_points_truth(offsets: np.ndarray, intervals) -> float:
    delta = (np.arange(200_000) + 0.5) / 200_000  # midpoint rule over the shift Δ
    return float(in_set((offsets[:, None] + delta[None, :]) % 1.0, intervals).any(axis=0).mean())


def truth(design: str, k: int) -> tuple[float, float]:
    """(true pass@k of the size-k design, its standard error: 0 where exact)."""
    if design == "lattice":
        return shifted_points_truth(np.arange(k) / k, INTERVAL), 0.0
    if design == "antithetic":
        pair = 0.2  # |TWO ∪ (1 − TWO)|: four disjoint intervals of 0.05
        return 1 - (1 - pair) ** (k // 2) * (1 - 0.1) ** (k % 2), 0.0
    hits = correct("sobol", 20 * REPS, k, first_seed=10**9).any(axis=1)  # independent scrambles
    return float(hits.mean()), float(hits.std(ddof=1) / np.sqrt(len(hits)))


def z_score(values: np.ndarray, true: float, true_se: float) -> float:
    se = np.hypot(values.std(ddof=1) / np.sqrt(len(values)), true_se)
    return (values.mean() - true) / se if se > 0 else (0.0 if values.mean() == true else np.inf)


Z_SCORES: dict[tuple[str, int, int], float] = {}


@pytest.mark.parametrize(("design", "n", "k"), CASES)
def test_the_sub_design_estimator_is_unbiased(design, n, k):
    values = per_group_pass_at_k(correct(design, REPS, n), k, design)
    z = z_score(values, *truth(design, k))
    Z_SCORES[(design, n, k)] = z
    assert abs(z) < Z_CRIT, (design, n, k, values.mean(), truth(design, k))


def test_worst_z_score_over_designs_sizes_and_ks():
    # Summary for the record (pytest -s prints it); each case is asserted above.
    if len(Z_SCORES) == len(CASES):
        worst = max(Z_SCORES, key=lambda c: abs(Z_SCORES[c]))
        z = abs(Z_SCORES[worst])
        print(f"\nworst |z| = {z:.2f} at {worst} over {len(CASES)} (design, N, k); critical {Z_CRIT:.2f}")


def test_contiguous_blocks_of_a_natural_order_lattice_are_biased():
    # Why N = 12 needs the stride sub-lattices: members i, i+1 are 1/12 apart, not 1/2.
    c = correct("lattice", REPS, 12)
    contiguous = c.reshape(REPS, 6, 2).any(axis=2).mean(axis=1)
    assert contiguous.mean() == pytest.approx(1 / 12 + 0.1, abs=0.01)  # ≈ 0.183, the truth is 0.2
    assert per_group_pass_at_k(c, 2, "lattice").mean() == pytest.approx(0.2, abs=0.01)


def test_sub_designs_are_blocks_for_power_of_two_and_strides_otherwise():
    assert sub_designs("lattice", 8, 2).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sub_designs("lattice", 12, 3).tolist() == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    assert sub_designs("sobol", 12, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert sub_designs("antithetic", 12, 6).tolist() == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    for design in ("lattice", "sobol", "antithetic", "stratified", "arithmetic"):
        for n in (1, 5, 12, 16):
            assert n in valid_ks(design, n)  # k = N always: the group's own success
            assert sub_designs(design, n, n).tolist() == [list(range(n))]


def test_stratified_and_arithmetic_at_k_equals_n_are_unbiased():
    n = 16
    strat = per_group_pass_at_k(correct("stratified", REPS, n), n, "stratified")
    # Strata [0, 1/16) and [1/2, 9/16) each hold one uniform point; each lands in TWO w.p. 0.8.
    assert abs(z_score(strat, 1 - 0.2 * 0.2, 0.0)) < Z_CRIT
    arith = per_group_pass_at_k(correct("arithmetic", REPS, n), n, "arithmetic")
    assert abs(z_score(arith, shifted_points_truth((np.arange(n) + 1) / (n + 1), TWO), 0.0)) < Z_CRIT
    with pytest.raises(ValueError, match=r"k=4 is not estimable for design 'stratified'.*use k = N = 16"):
        pass_at_k(correct("stratified", 10, n), 4, "stratified")
    assert valid_ks("arithmetic", 8) == [8]


def test_classical_estimator_values():
    assert classical_pass_at_k(10, 0, 3) == 0.0
    assert classical_pass_at_k(10, 8, 3) == 1.0
    assert classical_pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert classical_pass_at_k(4, 1, 2) == pytest.approx(0.5)


@pytest.mark.parametrize("k", [1, 4])
def test_classical_estimator_is_unbiased_for_iid_groups(k):
    values = per_group_pass_at_k(in_set(uniforms("iid", REPS, 16), TWO), k, "iid")
    assert abs(z_score(values, 1 - (1 - 0.1) ** k, 0.0)) < Z_CRIT


def test_the_classical_estimator_is_biased_for_lattice_groups():
    # The reason the sub-design estimator exists: k-subsets of a lattice group are not
    # size-k lattices. With two intervals half a unit apart the truth at k = 2 is 0.1
    # (a 2-lattice hits both or neither); the classical estimator says ~0.19.
    c = in_set(uniforms("lattice", REPS, 16), TWO)
    classical = per_group_pass_at_k(c, 2, "iid")
    assert shifted_points_truth(np.arange(2) / 2, TWO) == pytest.approx(0.1, abs=1e-3)
    assert classical.mean() - 0.1 > 10 * classical.std(ddof=1) / np.sqrt(REPS)


def test_bad_k_and_shapes_are_rejected():
    with pytest.raises(ValueError, match=r"k=17 must be an integer in \[1, N=16\]"):
        pass_at_k(np.zeros((2, 16), bool), 17, "lattice")
    with pytest.raises(ValueError, match=r"k=3 is not estimable for design 'lattice' with N=16"):
        pass_at_k(np.zeros((2, 16), bool), 3, "lattice")
    with pytest.raises(ValueError, match=r"k=5 is not estimable for design 'lattice' with N=12: use k in \[1, 2, 3"):
        pass_at_k(np.zeros((2, 12), bool), 5, "lattice")
    with pytest.raises(ValueError, match=r"correct must be a \[groups, N\] bool array"):
        pass_at_k(np.zeros(16, bool), 1, "iid")
    with pytest.raises(ValueError, match=r"design='latice' is not a design"):
        pass_at_k(np.zeros((2, 16), bool), 2, "latice")


def test_union_bound():
    assert union_bound([0.1, 0.5], 4) == pytest.approx((0.4 + 1.0) / 2)


def test_samples_saved_needs_a_target_above_zero_and_a_real_crossing():
    curve = {1: 0.2, 2: 0.4, 4: 0.6, 8: 0.8}
    assert samples_saved(curve, 0.8, 8) is None  # reached only at k = n: no saving to claim (not "0 %")
    assert samples_saved({1: 0.5, 2: 0.9, 4: 1.0}, 1.0, 4) is None  # both saturate at k = n
    assert samples_saved(curve, 0.5, 8) == pytest.approx(100 * (1 - 2**1.5 / 8))
    assert samples_saved(curve, 0.9, 8) is None  # never reached
    assert samples_saved({1: 0.0, 2: 0.0, 4: 0.0}, 0.0, 4) is None  # every sample failed: nothing to claim
    assert samples_saved({1: 0.5, 2: 0.5, 4: 0.5}, 0.5, 4) is None  # at the target already at k = 1


def test_samples_saved_carries_an_interval_that_says_what_the_problems_cannot_tell():
    rng = np.random.default_rng(0)
    problems = 40
    iid = [np.array([rng.random() < 0.5]).astype(float) for _ in range(problems)]
    method = [{1: np.array([0.2]), 2: np.array([0.45]), 4: np.array([float(rng.random() < 0.9)])} for _ in iid]
    figure = bootstrap_samples_saved(method, iid, 4, resamples=500)
    assert figure is not None and 0 < figure.low <= figure.value <= figure.high < 75, figure
    # A noisy method whose crossing the problems cannot place: "no saving" is not ruled out.
    coin = [{1: np.array([0.3]), 2: np.array([0.5]), 4: np.array([float(rng.random() < 0.55)])} for _ in iid]
    noisy = bootstrap_samples_saved(coin, iid, 4, resamples=500)
    assert noisy is not None and noisy.low == 0 < noisy.value <= noisy.high, noisy
    nothing = [{1: np.zeros(1), 2: np.zeros(1), 4: np.zeros(1)} for _ in range(4)]
    assert bootstrap_samples_saved(nothing, [np.zeros(1)] * 4, 4, resamples=100) is None


def test_samples_saved_of_curves_that_tie_at_one_is_not_a_point():
    """Issue 48: every problem solved by both at k ≥ 2 put every resample's crossing at k = 2 (50 %
    fewer than 4, a zero-width interval); the curves tie from k = 2 on, so any saving from 0 % (k = 4)
    to 50 % fits the data, and what lies between k = 1 and 2 is bounded by the problems at k = 1."""
    rng = np.random.default_rng(1)
    method = [{1: np.array([rng.uniform(0.6, 1.0)]), 2: np.ones(1), 4: np.ones(1)} for _ in range(48)]
    figure = bootstrap_samples_saved(method, [np.ones(1)] * 48, 4, resamples=1000)
    assert figure is not None and figure.value == pytest.approx(50.0)
    assert figure.low == 0.0 and 50.0 < figure.high < 75.0, figure


def test_values_at_the_bounds_get_the_exact_binomial_interval():
    """Issue 48: 48 of 48 problems solved gave [1, 1]. Values all at the bounds are a binomial count and
    get Clopper–Pearson's interval: (α/2)^(1/P) is its lower bound at P of P (Clopper & Pearson 1934)."""
    assert bounded_mean_interval(np.ones(48)) == (1.0, pytest.approx(0.025 ** (1 / 48)), 1.0)
    assert bounded_mean_interval(np.zeros(48)) == (0.0, 0.0, pytest.approx(1 - 0.025 ** (1 / 48)))
    assert 0.025 ** (1 / 48) == pytest.approx(0.9260, abs=1e-4)
    for s_, p in ((46, 48), (40, 48), (3, 10)):
        _, low, high = bounded_mean_interval(np.r_[np.ones(s_), np.zeros(p - s_)])
        exact = stats.beta.ppf(0.025, s_, p - s_ + 1), stats.beta.ppf(0.975, s_ + 1, p - s_)
        assert (low, high) == pytest.approx(exact)
    assert bootstrap_pass_at_k([np.ones(3)] * 48, 4).low == pytest.approx(0.9260, abs=1e-4)


def test_values_between_the_bounds_get_the_bootstrap_with_half_an_unseen_problem():
    """Every value c: the Bayesian bootstrap's weighted mean is c, and the atom of weight ½ at the far bound
    makes the lower bound c·Beta(P, ½) and the upper c + (1 − c)·Beta(½, P) (quantiles 0.025, 0.975).
    Monte Carlo with 40,000 draws: a quantile's standard error is below 0.001, so 0.004 is four of them."""
    value, low, high = bounded_mean_interval(np.full(48, 0.5), resamples=40_000, seed=3)
    assert value == 0.5
    assert low == pytest.approx(0.5 * stats.beta.ppf(0.025, 48, 0.5), abs=0.004)
    assert high == pytest.approx(0.5 + 0.5 * stats.beta.ppf(0.975, 0.5, 48), abs=0.004)
    # Near a bound the exact bound of the values rounded away from it is the wider: 47 solved and one
    # nearly, rounded up, is 48 of 48, so the lower bound is Clopper–Pearson's, not tighter than it.
    assert bounded_mean_interval(np.r_[np.ones(47), 0.9])[1] == pytest.approx(0.025 ** (1 / 48))


def test_the_bounded_mean_interval_rescales_its_bounds_and_refuses_values_outside():
    ones = np.ones(48)  # every problem solved at its first sample, cap 32: the count at the lower bound
    assert bounded_mean_interval(ones, lo=1, hi=32) == (1.0, 1.0, pytest.approx(1 + 31 * (1 - 0.025 ** (1 / 48))))
    assert np.isnan(bounded_mean_interval([0.3])[1:]).all()  # one problem: no interval
    with pytest.raises(ValueError, match=r"values must lie in \[lo, hi\] = \[0.0, 1.0\]; got \[0.0, 2.0\]"):
        bounded_mean_interval([0.0, 2.0])
    with pytest.raises(ValueError, match="non-empty array of finite numbers"):
        bounded_mean_interval([0.5, float("nan")])


def test_the_median_interval_is_the_order_statistics_of_the_binomial_ranks():
    # n = 48: ranks 17 and 32 (P(Bin(48, ½) ≤ 16) = 0.0147 ≤ 0.025 < P(≤ 17) = 0.0297).
    assert median_interval(np.arange(1.0, 49.0)) == (24.5, 17.0, 32.0)
    assert np.isnan(median_interval(np.arange(5.0))[1:]).all()  # 5 values cannot make a 95% interval
    assert median_interval(np.arange(6.0))[1:] == (0.0, 5.0)  # 6: the extremes, 1 − 2/64 = 0.969
    assert median_interval(np.ones(30)) == (1.0, 1.0, 1.0)  # a median every problem shares is known


def test_bootstrap_interval_covers_the_mean_and_shrinks_with_more_problems():
    rng = np.random.default_rng(0)
    few = [rng.random(1) < 0.3 for _ in range(20)]
    many = [rng.random(1) < 0.3 for _ in range(400)]
    a = bootstrap_pass_at_k([f.astype(float) for f in few], 1)
    b = bootstrap_pass_at_k([m.astype(float) for m in many], 1)
    assert a.low <= a.value <= a.high and b.low <= b.value <= b.high
    assert (b.high - b.low) < (a.high - a.low)


def test_the_ratio_interval_inverts_the_bounded_mean_test_on_a_minus_r_b():
    """Each end r of the interval is where bounded_mean_interval of a − r·b, on [lo − r·hi, hi − r·lo],
    has 0 at its edge: accepted at r, rejected just outside (Fieller's idea with a bounded-mean test)."""
    rng = np.random.default_rng(4)
    p = rng.beta(4.0, 0.5, 48)  # samples to the first correct member, capped at 32: mostly 1, a rare long tail
    a, b = (np.minimum(rng.geometric(p), 32).astype(float) for _ in range(2))
    value, low, high = bounded_ratio_interval(a, b, lo=1, hi=32, resamples=500)
    assert value == pytest.approx(a.mean() / b.mean()) and 1 / 32 < low < value < high < 32

    def test(r):
        return bounded_mean_interval(a - r * b, lo=1 - 32 * r, hi=32 - r, resamples=500)

    assert test(low)[1] <= 0 < test(low * (1 - 1e-6))[1]
    assert test(high)[2] >= 0 > test(high * (1 + 1e-6))[2]
    assert test(value)[1] <= 0 <= test(value)[2]  # mean(a − r·b) = 0 at the point estimate


def ratio_by_mean_intervals(a, b, lo, hi, resamples):
    """bounded_ratio_interval as its docstring defines it: bisections in log r on bounded_mean_interval
    of a − r·b on [lo − r·hi, hi − r·lo], called anew at every r (what the function computed before it
    kept the Dirichlet draws' sums)."""
    from qmc_sampler.eval.stats.passk import _ratio_interval_ends

    value = a.mean() / b.mean()

    def test(r):
        return bounded_mean_interval(a - r * b, lo=lo - r * hi, hi=hi - r * lo, resamples=resamples)[1:]

    return value, *_ratio_interval_ends(value, lo, hi, test)


@pytest.mark.parametrize("case", ["tail", "at the bounds", "one at each bound", "few"])
def test_the_ratio_interval_is_the_mean_interval_inverted_at_every_r(case):
    """The same interval as inverting bounded_mean_interval r by r, to rounding: the same weights, the
    same branches — values at (hi, lo) land exactly on the bound (a one-ulp miss there took the
    Monte Carlo branch in place of Clopper–Pearson and narrowed the interval)."""
    rng = np.random.default_rng(9)
    lo, hi = (4.0, 64.0) if case != "tail" else (1.0, 32.0)
    a, b = {
        "tail": lambda: [np.minimum(rng.geometric(rng.beta(4.0, 0.5, 48)), 32).astype(float) for _ in range(2)],
        "at the bounds": lambda: [rng.choice([lo, hi], 30) for _ in range(2)],
        "one at each bound": lambda: [np.r_[np.full(6, lo), hi], np.r_[np.full(4, hi), lo, hi, lo]],
        "few": lambda: [np.array([lo, 10.0, hi]), np.array([hi, 5.0, lo])],
    }[case]()
    got = bounded_ratio_interval(a, b, lo=lo, hi=hi, resamples=300)
    assert got == pytest.approx(ratio_by_mean_intervals(a, b, lo, hi, resamples=300), rel=1e-9)


def test_the_ratio_interval_is_nan_without_problems_and_refuses_bounds_at_zero():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Mean of empty slice" where no problem is solved by both (a293917)
        assert np.isnan(bounded_ratio_interval([], [], lo=1, hi=32)).all()
        one = bounded_ratio_interval([2.0], [4.0], lo=1, hi=32)
    assert one[0] == 0.5 and np.isnan(one[1:]).all()
    assert np.isnan(bounded_ratio_interval([1.0, 2.0], [1.0], lo=1, hi=32)).all()  # not paired
    value, low, high = bounded_ratio_interval(np.ones(48), np.ones(48), lo=1, hi=32)
    assert value == 1.0 and low < 1 < high  # every problem at once by both: still an interval, not a point
    with pytest.raises(ValueError, match="bounds 0 < lo <= hi"):
        bounded_ratio_interval([1.0, 2.0], [1.0, 2.0], lo=0, hi=32)
    with pytest.raises(ValueError, match=r"values must lie in \[lo, hi\] = \[1, 32\]"):
        bounded_ratio_interval([1.0, 40.0], [1.0, 2.0], lo=1, hi=32)


def test_the_intervals_quantile_is_numpys_to_the_last_bit():
    from qmc_sampler.eval.stats.passk import _quantile

    rng = np.random.default_rng(11)
    for n in (1, 2, 3, 40, 500, 501):
        for x in (rng.standard_normal(n), np.round(rng.standard_normal(n), 1), np.full(n, 0.25)):
            for q in (0.0, 0.025, 0.5, 0.975, 1.0, float(rng.random())):
                assert _quantile(x, q) == float(np.quantile(x, q)), (n, q)
