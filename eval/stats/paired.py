"""Paired comparisons over a few independent units: the exact sign-flip test and a percentile bootstrap.

Two treatments measured on the same n units (a training seed run once with each design, say) give n
paired differences d_i = a_i − b_i, one per unit. :func:`sign_flip_p` is Fisher's randomisation test
of the mean difference (Fisher 1935, "The Design of Experiments", §21, on Darwin's paired plants;
Good 2000, "Permutation Tests", 2nd ed., Springer, on paired comparisons):
where the treatments do not differ, each d_i is as likely to be +|d_i| as −|d_i|, so the 2^n sign
patterns of the observed differences are equally likely, and the p-value is the share of them whose
mean is at least as far from 0 as the observed one — exact for every n, with no assumption on the
distribution of the differences, but never below 2 / 2^n. :func:`bootstrap_mean_interval` is the
percentile bootstrap of their mean (Efron & Tibshirani 1993, "An Introduction to the Bootstrap",
ch. 13): descriptive with a few units, where it is about the range of the differences and covers far
less than its level. :func:`sign_flip_interval` inverts the sign-flip test: the shifts of the mean
it does not reject, an interval as exact as the test.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["SIGN_FLIP_MOST", "bootstrap_mean_interval", "sign_flip_interval", "sign_flip_p"]

#: :func:`sign_flip_p` lists every sign pattern of at most this many differences (2^20 ≈ 10^6 patterns).
SIGN_FLIP_MOST = 20
#: :func:`sign_flip_interval` places each end by this many bisections (to 2^-50 of the search width).
INTERVAL_BISECTIONS = 50


def sign_flip_p(diffs: ArrayLike) -> float | None:
    """The exact two-sided sign-flip (randomisation) p-value of the mean of paired differences.

    The share of the 2^n sign patterns of the n differences (the observed one included) whose mean
    is at least as far from 0 as the observed mean (to 1e-12, so that rounding does not split a
    tie): Fisher's randomisation test of a zero mean difference (module docstring). Its least value
    is 2 / 2^n (0.25 with 3 differences, 2/1024 with 10), reached when no other pattern but the
    observed one's mirror image is as extreme.

    Args:
        diffs: ``[n]`` paired differences (a − b per unit).

    Returns:
        The p-value in (0, 1]; None with more than :data:`SIGN_FLIP_MOST` differences (2^n patterns
        too many to list).

    Raises:
        ValueError: no differences, or one that is not finite (NaN compares false: it would give p = 0).
    """
    d = _finite(diffs)
    n = len(d)
    if n == 0:
        raise ValueError("diffs must hold at least one difference")
    if n > SIGN_FLIP_MOST:
        return None
    means = np.abs(_sign_patterns(n) @ d) / n
    # The observed pattern is one of the rows: a tolerance relative to the differences' size keeps it counted
    # although the product sums in another order than d.mean().
    return float(np.mean(means >= abs(d.mean()) - 1e-12 * (1.0 + float(np.abs(d).mean()))))


def bootstrap_mean_interval(
    diffs: ArrayLike, rng: np.random.Generator, *, resamples: int = 10_000, level: float = 0.95
) -> tuple[float, float] | None:
    """The percentile bootstrap interval of the mean of ``diffs`` (Efron & Tibshirani 1993, ch. 13).

    ``resamples`` samples of n of the n differences, drawn with replacement; the interval is the
    (1 ∓ ``level``)/2 quantiles (numpy's default, linear) of their means. Descriptive only with a
    few differences: it lies within [min, max] of them, is about that range with 3–5, and covers
    the true mean far less often than ``level``.

    Args:
        diffs: ``[n]`` paired differences.
        rng: the resamples' generator, drawn from (so that several intervals can share one stream:
            the same figures on every rerun from the same seed).
        resamples: bootstrap samples; level: the quantiles' two-sided share.

    Returns:
        ``(low, high)``; None with fewer than 2 differences (nothing to resample).

    Raises:
        ValueError: a difference that is not finite.
    """
    d = _finite(diffs)
    if len(d) < 2:
        return None
    means = d[rng.integers(0, len(d), (resamples, len(d)))].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def sign_flip_interval(diffs: ArrayLike, level: float = 0.95) -> tuple[float, float] | None:
    """The interval of mean shifts μ that the sign-flip test does not reject: every μ at which
    :func:`sign_flip_p` of ``diffs − μ`` exceeds 1 − ``level`` (a confidence set by inverting a test,
    Lehmann & Romano 2005, "Testing Statistical Hypotheses", §3.5).

    Its coverage is at least ``level`` for any distribution of differences symmetric about their mean,
    as the test's size is; the mean of the differences is always inside (its p-value is 1). Each end
    is placed by :data:`INTERVAL_BISECTIONS` bisections between the mean, accepted, and a shift past
    every difference's distance from it, rejected (where the test can reject at all).

    Args:
        diffs: ``[n]`` paired differences; level: the two-sided coverage, in (0, 1).

    Returns:
        ``(low, high)``; ``(-inf, inf)`` where no shift can be rejected (2 / 2^n > 1 − level: n ≤ 5
        at 0.95); None with fewer than 2 or more than :data:`SIGN_FLIP_MOST` differences.

    Raises:
        ValueError: ``level`` outside (0, 1), or a difference that is not finite.
    """
    if not 0 < level < 1:
        raise ValueError(f"level={level} must be in (0, 1)")
    d = _finite(diffs)
    n = len(d)
    if n < 2 or n > SIGN_FLIP_MOST:
        return None
    alpha = 1 - level
    if 2 / 2**n > alpha + 1e-12:  # the least p-value 2 / 2^n: no shift rejected (at == alpha, p ≤ alpha rejects)
        return float("-inf"), float("inf")
    center = float(d.mean())
    far = 2 * float(np.abs(d - center).max()) + 1.0  # all of d − μ of one sign there: p = 2 / 2^n ≤ alpha
    ends = []
    for direction in (-1.0, 1.0):
        inside, outside = center, center + direction * far
        for _ in range(INTERVAL_BISECTIONS):
            mid = (inside + outside) / 2
            p = sign_flip_p(d - mid)
            inside, outside = (mid, outside) if p is not None and p > alpha else (inside, mid)
        ends.append(inside)
    return ends[0], ends[1]


def _finite(diffs: ArrayLike) -> np.ndarray:
    """``diffs`` as a flat float64 array, refused (ValueError) where one is NaN or infinite."""
    d = np.asarray(diffs, dtype=np.float64).ravel()
    if not np.isfinite(d).all():
        raise ValueError(f"diffs must be finite; got {d.tolist()}")
    return d


@lru_cache(maxsize=2)
def _sign_patterns(n: int) -> np.ndarray:
    """``[2^n, n]`` float64 of ±1: row k holds pattern k's signs (its bits). Cached: an interval's
    bisections test 100 shifts of the same n (2^20 × 20 float64 is 168 MB; two sizes kept)."""
    signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
    out = signs.astype(np.float64)
    out.flags.writeable = False
    return out
