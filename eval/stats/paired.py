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
less than its level.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["SIGN_FLIP_MOST", "bootstrap_mean_interval", "sign_flip_p"]

#: :func:`sign_flip_p` lists every sign pattern of at most this many differences (2^20 ≈ 10^6 patterns).
SIGN_FLIP_MOST = 20


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
        ValueError: no differences.
    """
    d = np.asarray(diffs, dtype=np.float64).ravel()
    n = len(d)
    if n == 0:
        raise ValueError("diffs must hold at least one difference")
    if n > SIGN_FLIP_MOST:
        return None
    signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)  # [2^n, n]: ±1, pattern k's bits
    means = np.abs((signs * d).mean(axis=1))
    return float(np.mean(means >= abs(d.mean()) - 1e-12))


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
    """
    d = np.asarray(diffs, dtype=np.float64).ravel()
    if len(d) < 2:
        return None
    means = d[rng.integers(0, len(d), (resamples, len(d)))].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)
